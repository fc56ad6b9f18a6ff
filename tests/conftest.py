"""Suite-wide settings: generated C compiles with warnings as errors here (users' builds only log them);
hypothesis runs derandomized under CI (a red run reproduces, and prints the failing example's blob)."""
import os

from hypothesis import settings

os.environ["TAPEGRAD_WERROR"] = "1"

settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
