"""The toolkit's version, kept import-light so `aphrodite --version` stays fast."""

__version__ = "0.1.0"
