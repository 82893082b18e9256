"""The report: the value every check's findings go into and every renderer reads, and the `show` inventory."""
