"""tapegrad's version, one place for the package and its environment report."""
__version__ = "0.1.0"
