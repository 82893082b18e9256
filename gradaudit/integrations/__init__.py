"""Auditing a step inside training frameworks, one module per framework, each importing it lazily.

- `gradaudit.integrations.accelerate.AccelerateAudit`: Accelerate loops (gradient accumulation included).
- `gradaudit.integrations.transformers.GradAuditCallback`: HF `Trainer`.
- `gradaudit.integrations.lightning.GradAuditCallback`: Lightning `Trainer`.
- `gradaudit.integrations.torchtitan`: a recipe and a clip function for torchtitan-style loops.

gradaudit never requires these frameworks: each module imports its own only when used.
"""
