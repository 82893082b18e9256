"""Tests of gradaudit.report and gradaudit.render: report values and their renderings."""
