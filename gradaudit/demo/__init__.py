"""`gradaudit demo`: real multi-process training steps with real clipping mistakes, and their references."""

from .registry import SCENARIOS, Scenario, get_scenario, scenario_names, scenario_table
from .run import DemoOutputExists, DemoResult, DemoRunFailed, run_demo, scenario_dirs

__all__ = [
    "SCENARIOS",
    "DemoOutputExists",
    "DemoResult",
    "DemoRunFailed",
    "Scenario",
    "get_scenario",
    "run_demo",
    "scenario_dirs",
    "scenario_names",
    "scenario_table",
]
