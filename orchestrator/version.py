"""ddp-up's version: a leaf module, so that every command can say it without importing the package's face."""

__version__ = "0.1.0"
