"""Suite-wide settings: generated C compiles with warnings as errors here (users' builds only log them)."""
import os

os.environ["TAPEGRAD_WERROR"] = "1"
