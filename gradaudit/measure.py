"""Moved to gradaudit.engine.measure; this name stays while other branches still import it."""

from .engine.measure import (
    COMPARED_KINDS,
    ParamMeasurement,
    PieceMeasurement,
    ReferenceError,
    ReplicaCopy,
    ReplicaSet,
    StepMeasurements,
    bytes_to_read,
    measure_param,
    measure_step,
)

__all__ = [
    "COMPARED_KINDS",
    "ParamMeasurement",
    "PieceMeasurement",
    "ReferenceError",
    "ReplicaCopy",
    "ReplicaSet",
    "StepMeasurements",
    "bytes_to_read",
    "measure_param",
    "measure_step",
]
