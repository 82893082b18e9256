"""Auditing a step inside training frameworks, one module per framework, each importing it lazily.

- `gradaudit.integrations.accelerate.AccelerateAudit`: Accelerate loops (gradient accumulation included).
- `gradaudit.integrations.transformers.GradAuditCallback`: HF `Trainer`.
- `gradaudit.integrations.lightning.GradAuditCallback`: Lightning `Trainer`.
- `gradaudit.integrations.torchtitan.TorchtitanAudit`: torchtitan's `Trainer`.
- `gradaudit.integrations.deepspeed.DeepSpeedAudit`: DeepSpeed ZeRO stages 1-3.

The guard on every step (`gradaudit.guard`), one module per framework beside them:
`lightning_guard.GuardCallback`, `transformers_guard.GuardCallback`, `accelerate_guard.accelerate_guard`,
`deepspeed_guard.DeepSpeedGuard`, `torchtitan_guard.TorchtitanGuard`.

gradaudit never requires these frameworks: each module imports its own only when used.
"""
