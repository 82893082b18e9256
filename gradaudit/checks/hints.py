"""Hints in the words of the API the dump was captured with (recorded in each rank file as `capture_api`)."""

from __future__ import annotations

from ..model import StepFacts

_RECORD_PARAMETERS = {
    "audit_step": "pass optimizer= to audit_step",
    "begin_audit": "pass optimizer= to begin_audit",
    "dump": "gradaudit.dump records the gradients only: capture with audit_step(..., optimizer=opt) instead",
    "DeepSpeedAudit": "DeepSpeedAudit cannot record them: ZeRO frees its partitions inside engine.step()",
    "AccelerateAudit": "AccelerateAudit records them when the prepared optimizer steps inside the audited step",
    "TorchtitanAudit": "TorchtitanAudit records them around trainer.optimizers.step() inside the audited step",
    "transformers.GradAuditCallback": "the callback records them when the Trainer's optimizer steps in the "
    "audited step",
    "lightning.GradAuditCallback": "the callback records them when Lightning's optimizer steps in the "
    "audited step",
    "guard": "the guard's dump of a wrong step holds its group norms only: check the next step's full "
    "capture (under full/ in the guard's out_dir)",
    "guard.params": "the guard's dump of a step whose replicas differ holds its gradients' norms only: check "
    "the next step's full capture (under full/ in the guard's out_dir)",
    "guard.full": "the guard's full capture records them when the guarded optimizer steps in the captured step",
}


def capture_api(step: StepFacts) -> str | None:
    """The API that captured the step (from its first present rank), or None when the files do not say."""
    for rank in step.ranks_present:
        return step.ranks[rank].capture_api
    return None


def record_parameters_hint(step: StepFacts) -> str:
    """How to get the parameters before and after the optimizer step recorded, with this step's API."""
    api = capture_api(step)
    return _RECORD_PARAMETERS.get(api or "", "pass optimizer= to audit_step or begin_audit")
