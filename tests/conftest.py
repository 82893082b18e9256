import os

os.environ.setdefault("COLUMNS", "100")


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite the golden files in tests/golden/ from the current renderers (review the diff before committing)",
    )
