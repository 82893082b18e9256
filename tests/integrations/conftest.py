import sys
from pathlib import Path

# The launcher, tiny models and reassembly helpers live beside the older integration tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
