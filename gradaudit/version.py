"""The package version and the dump format version it writes and reads."""

__version__ = "0.2.0"

FORMAT_NAME = "gradaudit-dump"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
