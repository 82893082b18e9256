"""The one table of finding codes: per code its severity, title, check function, explanation, rank in
the verdict, and whether it can be decided with ranks missing.

The check modules are named here but imported only when a check first runs, so that `gradaudit explain`
reads this table without loading the measuring code (see `deferred`).
"""

from __future__ import annotations

import importlib
import textwrap
from dataclasses import dataclass

from ..report.model import Finding, NotChecked, Severity
from .base import Analysis, AuditOptions, CheckFn, CheckResult, CheckSpec


@dataclass(frozen=True)
class DeferredCheck:
    """`module.function` of this package, imported on its first call."""

    module: str
    """The module under gradaudit/checks/ that holds the check."""
    function: str
    """The check's function in it."""

    def resolve(self) -> CheckFn:
        fn: CheckFn = getattr(importlib.import_module(f"{__package__}.{self.module}"), self.function)
        return fn

    def __call__(self, inputs: Analysis, options: AuditOptions) -> CheckResult:
        return self.resolve()(inputs, options)


def deferred(target: str) -> DeferredCheck:
    """The check `module.function` of this package, imported on its first call."""
    return DeferredCheck(*target.split("."))


ERROR, WARNING, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO

# The table is laid out by hand (the formatter would put each field on a line of its own): a row's
# head (code, severity, verdict rank, check, title, flags), then the four sections `gradaudit explain` prints.
# fmt: off
CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec(code="GA100", severity=ERROR, verdict_rank=210, run=deferred("coverage.missing_ranks"),
        title="ranks missing from the step folder", decided_with_ranks_missing=True,
        what="Every rank of the world size has a file in the step folder.",
        why="The true global norm needs every rank's gradient pieces. With ranks missing, gradaudit audits the rest, "
        "but every check that needs the missing pieces says it could not decide instead of guessing.",
        example="A 4-rank run whose step_1200 folder holds rank_00000 to rank_00002: rank 3 crashed before it "
        "wrote its dump, or its file was not copied from its host.",
        fix="Copy the missing rank files into the step folder (each host writes its own ranks), or re-run the "
        "step with the capture hook enabled on every rank."),
    CheckSpec(code="GA101", severity=ERROR, verdict_rank=10, run=deferred("coverage.metadata_disagreement"),
        title="ranks disagree on run metadata", decided_with_ranks_missing=True,
        what="All ranks agree on the step, world size, run id, max_norm, norm type, every parameter's global "
        "shape and dtype, and the process-group topology.",
        why="Files from different steps or runs cannot be combined into one gradient; a rank that clips with "
        "another max_norm or norm type applies another rule than the others.",
        example="rank_00001.safetensors was written at step 1199 while the others are step 1200, or one rank "
        "has max_norm 0.5 from a stale config.",
        fix="Make sure the step folder holds files from one step of one run; if the config differs per rank, "
        "fix how the training script reads it."),
    CheckSpec(code="GA102", severity=ERROR, verdict_rank=50, run=deferred("coverage.ownership_overlap"),
        title="ownership overlap",
        what="No element of a parameter is held by two pieces that are not identical replicas.",
        why="Two different pieces claiming the same elements would count those elements twice in any norm; it "
        "means the ownership map (offsets, shard sizes, padding) is wrong.",
        example="An uneven FSDP1 shard whose flat range includes the previous rank's last elements, or a "
        "tensor-parallel column split with an off-by-one offset.",
        fix="Check how the shard offsets were derived (padding of the last shard, uneven splits). With the "
        "built-in capture, report a bug with `gradaudit show` output."),
    CheckSpec(code="GA103", severity=ERROR, verdict_rank=60, run=deferred("coverage.ownership_gap"),
        title="ownership gap",
        what="Every element of every parameter is held by some rank.",
        why="Elements no rank holds are absent from the recomputed norm, so the audit would underestimate it; "
        "usually an ownership map that forgets padding-free tails or expert shards.",
        example="An MoE layer whose expert 7 lives on a rank that did not dump it, or a flat range that stops "
        "one row short.",
        fix="Dump every rank and every parameter that has a gradient; check the offsets of the last shard."),
    CheckSpec(code="GA104", severity=WARNING, verdict_rank=70, run=deferred("coverage.parameters_not_captured"),
        title="parameters the capture left out", decided_with_ranks_missing=True,
        what="Every parameter with a gradient was captured. The capture leaves out a parameter it cannot "
        "store (a sparse gradient, a dtype the format does not hold, a complex gradient under a norm other "
        "than 2) and lists it in the dump; this check then says it could not decide, naming them.",
        why="A parameter left out is in no norm gradaudit recomputes, while the training code's norm "
        "included it: the true norm and every verdict built on it describe the other parameters only.",
        example="An nn.Embedding(sparse=True) whose gradient is a sparse COO tensor: the dump holds every "
        "other parameter and lists the embedding as 'sparse gradient (sparse_coo)'.",
        fix="Audit with a dense gradient for that parameter (sparse=False for one step), or accept that the "
        "report covers the other parameters only."),
    CheckSpec(code="GA201", severity=ERROR, verdict_rank=100, run=deferred("norm.local_norm"),
        title="clipping used a local norm", norm_clipping=True, decides_clipping=True,
        what="Each rank's reported norm (or the norm its coefficient implies) against the norm of its own pieces only.",
        why="A norm that is never reduced across ranks is smaller than the global one: every shard can be under "
        "max_norm while the whole gradient is far above it, so no rank clips and the update is too large.",
        example="Four FSDP2 ranks each clip their to_local() gradients: each sees 0.8 < max_norm 1 and applies "
        "coefficient 1, while the true global norm is sqrt(4 x 0.8^2) = 1.6 and the coefficient should be 0.625.",
        fix="With FSDP2 or DTensor tensor parallelism, clip with torch.nn.utils.clip_grad_norm_ on the DTensor "
        "parameters themselves, not on their to_local() shards. With FSDP1, call the root module's "
        "FSDP.clip_grad_norm_, not torch's clip_grad_norm_ on the flat shards. With DeepSpeed, set gradient_clipping "
        "in the config and let engine.step() clip, or, clipping by hand, all-reduce the sum of squares of every "
        "rank's partition before taking the root. With Megatron-style tensor parallelism, all-reduce the sum of "
        "|g|^p over the tensor- and data-parallel groups, counting replicated parameters once, before taking the "
        "root. Otherwise, all-reduce the sum of |g|^p over the ranks that shard the parameters before taking the root."),
    CheckSpec(code="GA202", severity=ERROR, verdict_rank=110, run=deferred("norm.double_counted"),
        title="norm counts replicated gradients more than once", norm_clipping=True, decides_clipping=True,
        what="The reported norm against the norm of all ranks' pieces with every replica counted once per copy, "
        "and against the norm of each named group that holds every element counted once per member (every rank "
        "computed the full norm, then the squares were summed over the group again: sqrt(group size) times it; "
        "a group that holds part of the elements only, summed so, is GA203).",
        why="Replicated gradients (DDP/HSDP replicas, tensor-parallel LayerNorm and bias, tied embeddings on two "
        "pipeline stages) hold the same elements; summing every copy inflates the norm, so clipping is too strong.",
        example="HSDP with 2 replicas of a 2-way shard: a hand-rolled norm all-reduced over all 4 ranks is "
        "sqrt(2) times the true norm. Under ZeRO-3, squares of safe_get_full_grad all-reduced over the world: "
        "sqrt(world size) times it.",
        fix="Reduce the squared norm over the shard group only (each replica holds the same values), or divide "
        "replicated contributions by their replica count before the all-reduce."),
    CheckSpec(code="GA203", severity=ERROR, verdict_rank=120, run=deferred("norm.wrong_group"),
        title="norm reduced over the wrong process group", norm_clipping=True, decides_clipping=True,
        what="The reported norm against the norm of the pieces held by one named process group of this rank "
        "(replicas once, or every replica counted) and, when the group holds part of the elements only, against "
        "that norm summed over the group again (each member held the group's full norm, as a DTensor's norm is, "
        "and the squares were all-reduced over the same group instead of across the others); the finding names "
        "the group the norm was reduced over.",
        why="Reducing over the wrong group (one pipeline stage, the shard axis without the others) gives each "
        "group its own coefficient: ranks apply different scales to one logical update. A mistake confined to "
        "one group of parameters (experts left out, or reduced over the wrong group) is GA207.",
        example="Two pipeline stages each clip by their own stage norm: stage 0 sees 0.9, stage 1 sees 1.2, "
        "and neither is the true norm 1.5. Or, with FSDP2 inside each stage, the squared stage norms all-reduced "
        "over the data-parallel group instead of the pipeline group: each rank reports sqrt(2) times its stage "
        "norm (1.27 and 1.70), named as reduced over 'dp_shard'.",
        fix="All-reduce the sum of |g|^p over every group that splits the parameters (pp and the shard axes), "
        "once per replica; torch's clip_grad_norm_ on DTensors handles the mesh, pipeline stages need an extra "
        "all-reduce."),
    CheckSpec(code="GA204", severity=ERROR, verdict_rank=160, run=deferred("norm.unexplained"),
        title="norm matches no known mistake", norm_clipping=True, decides_clipping=True,
        what="Whether the reported norm matches any candidate at all (true, local, double-counted, per process "
        "group, loss-scaled, one parameter group wrong (GA207), averaged (GA208), overflowed (GA209), a parameter "
        "listed twice or one clip call per param group (GA210)).",
        why="A norm that matches no known accounting may come from a bug gradaudit does not model, a norm "
        "taken at another moment (before accumulation finished), or a mismatched dump.",
        example="Rank 0 reports 3.7 while the true norm is 1.6, its local norm 0.8 and every group norm below 1.6.",
        fix="Compare the numbers in the finding; check when the norm was computed relative to accumulation, "
        "unscaling and the dump, and whether the dump captured the gradients that were clipped."),
    CheckSpec(code="GA205", severity=WARNING, verdict_rank=250, run=deferred("norm.logging_bug"),
        title="reported norm is wrong but clipping used the right one", norm_clipping=True,
        what="Ranks whose reported norm is wrong while the coefficient they applied is the one the true norm asks for.",
        why="Clipping itself was right, but dashboards and alerts built on the logged norm are wrong, which "
        "hides real spikes or invents false ones.",
        example="A training loop logs the local norm of rank 0 while clip_grad_norm_ on DTensors clipped with "
        "the global one.",
        fix="Log the value returned by the clipping call (made a full tensor) rather than a locally computed norm."),
    CheckSpec(code="GA206", severity=WARNING, verdict_rank=260, run=deferred("norm.not_checked"),
        title="clipping was not checked", norm_clipping=True,
        what="Whether the dump holds the evidence the clipping checks need: the gradient before clipping and, "
        "on some rank, a reported norm, a clip coefficient or the gradient after clipping.",
        why="Without that evidence GA201-GA204 and GA302 cannot run, and a report with no error would look like "
        "a pass. This warning says that clipping was not checked, and why, so that no one reads it as checked.",
        example="gradaudit.dump() called after clip_grad_norm_ in a step hook: the dump holds the clipped "
        "gradient and no norm, so nothing shows what clipping did.",
        fix="Capture with `with gradaudit.audit_step(...) as audit:` and clip through `audit.clip(...)`, or pass "
        "the norm the training code computed (`reported_norm=`) and call the dump before clipping."),
    CheckSpec(code="GA207", severity=ERROR, verdict_rank=130, run=deferred("norm.param_group_mistake"),
        title="norm accounts one group of parameters wrongly", norm_clipping=True, decides_clipping=True,
        what="When no whole-step accounting explains a rank's norm: the norm in which one group of parameters "
        "(parameters held alike, e.g. the experts of an MoE layer) is left out, counted on every rank that "
        "holds a replica, taken from the rank's own pieces, or reduced over another process group, while every "
        "other parameter is counted once.",
        why="Mixture-of-experts and mixed-parallel models reduce different parameters over different groups; "
        "getting one group wrong changes the norm by that group's share only, so the clip is slightly off on "
        "every step and no whole-step hypothesis matches.",
        example="Expert gradients replicated over 2 expert-data-parallel ranks, their squares all-reduced over "
        "the whole data-parallel world instead of the expert-parallel group: every expert counted twice.",
        fix="Reduce each parameter group's squares over the group that shards it (experts over the expert-"
        "parallel group), once per logical element, and include every group in the total."),
    CheckSpec(code="GA208", severity=ERROR, verdict_rank=140, run=deferred("norm.averaged_norms"),
        title="norm averages per-rank norms instead of summing squares",
        norm_clipping=True, decides_clipping=True,
        what="Whether a rank's norm is the mean of the ranks' local norms (or the root of the mean of their "
        "squares) over a process group, instead of the root of the sum of their squares.",
        why="Averaging norms across data-parallel ranks, as some legacy mixed-precision optimizers did, gives a "
        "number smaller than the global norm: clipping is too weak.",
        example="Four ZeRO ranks each compute the norm of their partition and all-reduce it with op=AVG.",
        fix="All-reduce the sum of |g|^p over the group with op=SUM and take the p-th root."),
    CheckSpec(code="GA209", severity=ERROR, verdict_rank=150, run=deferred("norm.overflowed"),
        title="norm overflowed in its working precision", norm_clipping=True, decides_clipping=True,
        what="Whether a rank's inf (or nan) norm is what the true norm becomes in a narrower working precision, "
        "while every gradient value is finite.",
        why="A norm that overflows zeroes the update (coefficient max_norm / inf = 0) or makes the step skipped "
        "by a loss scaler, although nothing in the gradients is nonfinite.",
        example="A gradient element of 1e20 in float32: its square, 1e40, is beyond float32's 3.4e38, so the fp32 "
        "norm is inf while the float64 norm is 1e20.",
        fix="Compute norms in float32 or float64 with scaling (torch.linalg.vector_norm scales for you on most "
        "backends; a hand-rolled sum of squares does not), or find why the gradient is that large."),
    CheckSpec(code="GA210", severity=ERROR, verdict_rank=135, run=deferred("norm.wrong_clip_list"),
        title="norm taken over the wrong list of parameters", norm_clipping=True, decides_clipping=True,
        what="When no whole-step accounting explains a rank's norm: the true norm with one parameter counted "
        "twice (norm^p = true^p + that parameter's |g|^p, what a parameter listed twice in the clip list gives; "
        "tried only where its measured coefficients agree: c^2 against the others' c), and, with several clip "
        "calls before one step, the last call's norm being that of its own parameters only (the calls' norms "
        "to the p add up to the true norm's before the first call: one clip call per optimizer param group). "
        "The finding names the parameter, or says the groups were clipped separately.",
        why="The norm is reduced right but over the wrong list. A parameter listed twice weighs twice in the "
        "norm, so every gradient is clipped too hard, and is scaled twice itself (c^2, GA304). Param groups "
        "clipped each by its own norm get coefficients of their own, none of them the true norm's: the update "
        "changes direction, and groups under max_norm are not scaled at all.",
        example="A tied output head added to the clip list again: clip_grad_norm_(list(model.parameters()) + "
        "[model.lm_head.weight], 0.1) reports 4.56 = sqrt(4.32^2 + 1.46^2), the true norm 4.32 with the "
        "embedding (1.46) counted twice. Or for g in optimizer.param_groups: clip_grad_norm_(g['params'], 1.8): "
        "two calls report 1.62 and 2.01, whose squares add up to the true norm 2.58 squared.",
        fix="List each parameter once: clip model.parameters(), which holds a tied weight once, not a list "
        "with both names of a tie or named_parameters(remove_duplicate=False). Clip once per step, with the "
        "norm of every param group together: "
        "torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g['params']], max_norm)."),
    CheckSpec(code="GA301", severity=ERROR, verdict_rank=180, run=deferred("coefficients.coefficients_differ"),
        title="ranks applied different clip coefficients", norm_clipping=True,
        what="All ranks applied the same clip coefficient to the gradient (within the dtype's tolerance).",
        why="One logical update must be scaled by one number; different coefficients per rank change the "
        "direction of the update, not just its length.",
        example="Two pipeline stages clipping by their own stage norms apply 0.8 and 0.5.",
        fix="Compute one global norm (see GA201-GA203) and apply its coefficient on every rank."),
    CheckSpec(code="GA302", severity=ERROR, verdict_rank=190, run=deferred("coefficients.coefficient_vs_expected"),
        title="applied coefficient differs from the expected one", norm_clipping=True, decides_clipping=True,
        what="Each rank's applied coefficient (measured from pre/post-clip gradients, else reported) against "
        "min(1, max_norm / (true_norm + 1e-6)).",
        why="This is the rule torch.nn.utils.clip_grad_norm_ promises; any other coefficient means the update "
        "was larger or smaller than intended.",
        example="Every rank applied 1 (no clipping) while the true norm 1.6 with max_norm 1 asks for 0.625.",
        fix="Fix the norm (see the GA2xx finding next to it); if the norm is right, check that the coefficient "
        "is applied to every gradient, including those outside the clipped parameter list."),
    CheckSpec(code="GA303", severity=ERROR, verdict_rank=200, run=deferred("coefficients.post_clip_norm"),
        title="post-clip global norm exceeds max_norm", decided_with_ranks_missing=True, norm_clipping=True,
        what="The global norm of the post-clip gradients is at most max_norm.",
        why="After correct clipping the norm cannot exceed max_norm; if it does, some gradients were not scaled "
        "or were scaled by a coefficient computed from too small a norm.",
        example="After clipping with local norms the recombined gradient still has norm 1.6 > max_norm 1.",
        fix="See the GA2xx/GA30x findings; make sure every parameter with a gradient is in the clipped list."),
    CheckSpec(code="GA304", severity=ERROR, verdict_rank=28, run=deferred("coefficients.coefficients_by_parameter"),
        title="parameters received different clip coefficients",
        decided_with_ranks_missing=True, norm_clipping=True,
        what="Every parameter received the same clip coefficient, measured per parameter from its pre- and "
        "post-clip gradients (from the values in full mode, from the ratio of the sums of squares in stats "
        "mode), the parameters grouped by the coefficient they share; a rank that applied several "
        "coefficients to its own parameters is named with each group, its coefficient and the expected one.",
        why="Clipping scales the whole gradient by one number. Parameters scaled by different numbers change "
        "the update's direction; and a rank's coefficient, averaged over parameters that received "
        "different ones, is a number no parameter received (GA301 and GA302 then compare nothing real).",
        example="A tied embedding listed twice in the clip list (named_parameters(remove_duplicate=False)): "
        "its squares count twice in the norm and its gradient is multiplied by c twice, c² against the "
        "others' c. Or get_total_norm and clip_grads_with_norm_ called once per optimizer param group: each "
        "group is scaled by its own norm (0.531 and 1.0) instead of the true global norm's coefficient.",
        fix="List each parameter once: clip model.parameters(), which holds a tied weight once, not "
        "named_parameters(remove_duplicate=False) or a list of both modules of a tie. Give the clip call "
        "every parameter the optimizer steps, e.g. model.parameters(). Clip once per step, with the norm of "
        "every param group together: "
        "torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g['params']], max_norm), "
        "or get_total_norm over all of their gradients and one clip_grads_with_norm_ with that norm."),
    CheckSpec(code="GA401", severity=ERROR, verdict_rank=40, run=deferred("nonfinite.nonfinite_gradients"),
        title="nonfinite gradient values",
        what="Counts of nan, +inf and -inf in every rank's pre-clip gradient pieces, per parameter, and the "
        "lowest rank where they appear.",
        why="One nonfinite element makes the global norm nonfinite; clip_grad_norm_ then scales every gradient "
        "by nan (unless error_if_nonfinite is set) and the weights are destroyed unless the step is skipped.",
        example="Rank 2's shard of layers.3.mlp.w1 holds 1 inf and 1 nan after an overflow in bf16.",
        fix="Use GradScaler (fp16) or find the overflowing op; pass error_if_nonfinite=True to catch it early; "
        "make sure every rank skips the step together (see GA402)."),
    CheckSpec(code="GA402", severity=ERROR, verdict_rank=170, run=deferred("nonfinite.skip_disagreement"),
        title="ranks disagree on nonfinite or skipped step",
        what="All ranks agree on whether nonfinite gradients were found and whether the optimizer step was skipped.",
        why="If only the ranks that saw the inf skip the step, the replicas and shards of one model drift apart.",
        example="A GradScaler whose found_inf is not all-reduced: rank 1 skips the step, ranks 0, 2 and 3 step.",
        fix="Use the sharded grad scaler of your stack (it all-reduces found_inf), or all-reduce found_inf with MAX."),
    CheckSpec(code="GA501", severity=ERROR, verdict_rank=30, run=deferred("procedure.clipped_more_than_once"),
        title="clipping ran more than once before one optimizer step",
        what="How many times clipping ran before one optimizer step, per rank, and (when the capture recorded "
        "statistics before each call) the true global norm before each call. The dumped gradient is the one "
        "before the last call, so every norm and coefficient the report derives says it is of that moment; "
        "from a dump that holds only the gradient before the first call, no replica or coefficient check is "
        "derived across the two moments.",
        why="Clipping each microbatch's partial gradient during accumulation clips a different vector than the "
        "accumulated gradient, so the update differs from the intended rule.",
        example="With 4 accumulation steps clip_grad_norm_ is called in the microbatch loop: 4 calls, each on a "
        "partial sum. Under FSDP2 with set_requires_gradient_sync(False) the first calls see no gradient at "
        "all (true norm 0); under DDP's no_sync() they clip each rank's unreduced partial gradient.",
        fix="Clip once, after the last backward of the accumulation window and before optimizer.step()."),
    CheckSpec(code="GA502", severity=ERROR, verdict_rank=90, run=deferred("procedure.clipped_scaled_gradients"),
        title="clipping ran on scaled gradients (before GradScaler.unscale_)",
        what="Whether clipping ran on gradients still multiplied by the GradScaler loss scale.",
        why="The scaled gradient's norm is the true norm times the scale, so clipping it at max_norm clips the "
        "true gradient at max_norm / scale: far too hard, and it changes as the scale changes.",
        example="scaler.scale(loss).backward(); clip_grad_norm_(params, 1.0); scaler.step(opt) with scale 65536: "
        "the reported norm is 65536 times the true one.",
        fix="Call scaler.unscale_(optimizer) before clip_grad_norm_."),
    CheckSpec(code="GA503", severity=ERROR, verdict_rank=20, run=deferred("postclip.captured_after_clipping"),
        title="gradients were captured after clipping",
        what="Whether the dumped gradients are the clipped ones: no clip call was recorded, and their global norm "
        "is max_norm itself (what clip_grad_norm_ leaves behind), while the norm the run recorded, if any, is above it.",
        why="The audit recomputes the norm clipping should have used from the dumped gradients. Captured after "
        "clipping, they are already scaled to max_norm, so the recomputed norm is the post-clip one and every "
        "clipping check would compare the clipped gradient with itself and pass.",
        example="gradaudit.dump() called from HF Trainer's on_pre_optimizer_step, which runs after the Trainer "
        "clipped: the dump's norm is exactly max_norm 1.0, while the Trainer logged grad_norm 3.2.",
        fix="Capture before clipping: wrap the clip call with audit.clip (or audit.intercept_clip), or use the "
        "framework's callback from gradaudit.integrations; call dump() only where the gradients are not yet clipped "
        "(after the last backward, before the clip call)."),
    CheckSpec(code="GA504", severity=ERROR, verdict_rank=24, run=deferred("unrecorded.clipped_before_the_recorded_call"),
        title="gradients were clipped before the recorded clip call", norm_clipping=True,
        what="Whether the gradients the recorded clip call saw were clipped already: one clip call per rank was "
        "recorded, the true global norm just before it is max_norm itself (to the rounding of the gradients' "
        "dtype), and the call then scaled nothing (coefficient 1).",
        why="A clip leaves gradients whose norm is max_norm. When another clip ran first, the recorded call sees "
        "them, computes max_norm and does nothing, and every check of it passes while the clip that mattered, "
        "its norm and its coefficient, went unseen: it may have used a local norm, or run per microbatch.",
        example="A training_step override calls a hand-written clip on each microbatch, then HF Trainer's own "
        "clip (recorded) logs grad_norm 1.0 with max_norm 1.0 on every step.",
        fix="Clip once per optimizer step, after the last backward, through audit.clip or a function gradaudit "
        "records (torch.nn.utils.clip_grad_norm_, clip_grads_with_norm_, FSDP's, Accelerate's); remove the "
        "earlier clip."),
    CheckSpec(code="GA505", severity=ERROR, verdict_rank=26, run=deferred("unrecorded.no_clip_call"),
        title="no clip call although max_norm was declared", norm_clipping=True,
        what="Whether a clip ran at all: max_norm was declared and the optimizer step was recorded, but no rank "
        "recorded a clip call (every call of a known clip function made while the audit is open is recorded), "
        "a reported norm or a coefficient. The headline's norm is then that of the gradients the step used.",
        why="A clip that never runs leaves every step above max_norm unclipped: a refactor that moved the clip "
        "behind a condition, a framework flag (max_grad_norm=0) or an early return loses it silently.",
        example="with gradaudit.audit_step(model, 'audit', step=s, max_norm=1.0, optimizer=opt): backward and "
        "opt.step(), no clip: the gradients had true norm 21.88, so the step should have been scaled by 0.0457.",
        fix="Clip after the last backward and before the optimizer step; if your code clips by hand, record what "
        "it computed with audit.record(reported_norm=..., clip_coef=...)."),
    CheckSpec(code="GA506", severity=ERROR, verdict_rank=22, run=deferred("valueclip.clipped_by_value"),
        title="clipping was element-wise (clip by value), not by norm",
        what="Whether the step clipped element-wise (torch.nn.utils.clip_grad_value_, Accelerate's "
        "clip_grad_value_): from the recorded call, or from the clamp it leaves (after it every piece's largest "
        "|element| is min(its own, v) for one v, and the norm shrank less than the largest element). The norm "
        "and coefficient checks are then not checked: element-wise clipping has neither.",
        why="Clipping by value is no norm clipping: it changes the gradient's direction and bounds no norm (n "
        "elements may keep norm up to sqrt(n) times the value), so a run that declares max_norm and clips by "
        "value does not do what it says, and any coefficient derived from it would be invented.",
        example="clip_grad_value_(model.parameters(), 0.01) with max_norm 1.0 declared: elements beyond 0.01 are "
        "cut to 0.01; the gradient's norm went from 21.9 to 0.84, a ratio no single coefficient applied.",
        fix="Call clip_grad_norm_ (or your stack's norm clip) if norm clipping was meant; if clipping by value "
        "is deliberate, audit the step without max_norm."),
    CheckSpec(code="GA601", severity=ERROR, verdict_rank=80, run=deferred("replicas.replicas_differ"),
        title="pieces that should be replicas differ",
        what="Copies of one piece on several ranks (replicas: equal parameter and regions) hold the same values, "
        "within the dtype's tolerance (or the same fingerprint in stats-only dumps).",
        why="Replicas that differ mean a missing or wrong all-reduce: the model copies drift apart and the norm "
        "depends on which copy is counted.",
        example="DDP where one rank's gradients were never all-reduced (no_sync left on): rank 1 differs from rank 0 "
        "by max |difference| 0.3.",
        fix="Check that every replicated gradient goes through the all-reduce (DDP hooks, HSDP replicate axis, "
        "tensor-parallel LayerNorm grads)."),
    CheckSpec(code="GA602", severity=ERROR, verdict_rank=220, run=deferred("reference.gradients_differ"),
        title="gradients differ from the unsharded reference",
        what="The sharded step's gradients, reassembled from their pieces, against one unsharded reference step "
        "of the same model and data (--reference): per parameter max absolute and relative error, and the "
        "global norm and expected coefficient.",
        why="It is the ground truth: if the pre-clip gradients already differ, the bug is upstream of clipping "
        "(loss weighting, a missing reduction, wrong data).",
        example="A rank's shard holds an inf the reference does not have; or every gradient is twice the "
        "reference because the loss was summed over replicas.",
        fix="Look at the worst parameters first; tune --rtol/--atol only if the differences are numerical noise."),
    CheckSpec(code="GA603", severity=ERROR, verdict_rank=230, run=deferred("reference.clipped_or_next_weights_differ"),
        title="clipped gradients or next weights differ from the unsharded reference",
        what="The clipped gradients and the next weights against the unsharded reference, when both dumps hold them.",
        why="Matching pre-clip gradients but different clipped gradients pin the bug on clipping; different next "
        "weights show what the bug did to the model.",
        example="Local-norm clipping: the gradients match the reference, the clipped gradients are 1.6 times larger.",
        fix="Fix the clipping finding reported next to it; then the clipped gradients should match."),
    CheckSpec(code="GA604", severity=INFO, verdict_rank=240, run=deferred("reference.updates_explained_by_optimizer"),
        title="next weights differ only as the optimizer's normalisation of agreeing gradients explains",
        decided_with_ranks_missing=True,
        what="For a parameter whose gradients agree with the reference but whose next weights do not: whether "
        "each element's difference is within what the reference's own update makes of the gradient tolerance "
        "(|update| / |gradient| x allowed gradient error; exactly lr x allowed error for SGD), and, for elements "
        "whose gradient is zero within tolerance, within twice the parameter's largest update element.",
        why="Adam divides each gradient element by its running magnitude: a gradient that is zero up to rounding "
        "(the key bias of attention, which the softmax's shift invariance makes mathematically zero) becomes a "
        "step of up to the learning rate in a direction set by noise. The sharded and unsharded runs round "
        "differently, so their next weights differ while nothing is wrong; this is reported instead of GA603.",
        example="blocks.0.attn.qkv.bias under AdamW: gradients agree within 1e-8, the key-bias gradient is about "
        "1e-11, and the next weights differ by 4.6e-7 against an allowed 2e-7.",
        fix="Nothing to fix when the gradients agree. To compare next weights tightly, use SGD for the audited "
        "step, or a larger Adam eps."),
    CheckSpec(code="GA605", severity=ERROR, verdict_rank=85, run=deferred("replica_weights.replica_weights_differ"),
        title="replicas' weights differ at the start of the step",
        what="Copies of one replicated piece hold the same parameter values at the start of the optimizer step "
        "(param_before, recorded with optimizer=; in stats mode for the parameters named in full_params=).",
        why="Replicas that start a step with different weights have drifted apart earlier: the ranks train "
        "different models from then on, while their gradients may still agree after the all-reduce, so no "
        "gradient check sees it.",
        example="Under DDP, step 7 clipped with a per-rank coefficient (GA301); the dump of step 8 holds weights "
        "that differ between rank 0 and rank 1 by 3e-3 although both gradients agree.",
        fix="Find the step where the ranks applied different coefficients or skipped differently (GA301, GA402) "
        "and fix it; restart from a checkpoint written before it."),
    CheckSpec(code="GA701", severity=INFO, verdict_rank=280, run=deferred("updates.update_vs_gradient"),
        title="update norm vs gradient norm", decided_with_ranks_missing=True,
        what="The norm of the optimizer's update (parameters after minus before) next to the gradient norm.",
        why="Clipping bounds the gradient, not an adaptive optimizer's update: Adam's update is about lr per "
        "element regardless of the gradient's size. This is information, not an error.",
        example="Update norm 0.05 with clipped gradient norm 1.0: the ratio depends on the optimizer, not the clip.",
        fix="Nothing to fix; if update size matters, monitor it (or clip updates) separately."),
    CheckSpec(code="GA702", severity=WARNING, verdict_rank=270, run=deferred("procedure.uneven_token_means"),
        title="ranks averaged their own loss over different token counts",
        what="Ranks that averaged their own loss (loss_reduction 'mean') over different token counts.",
        why="Averaging per-rank means weights each token by 1/(its rank's tokens): tokens in short batches count "
        "more, so the gradient is not the gradient of the global mean loss.",
        example="Rank 0 has 1000 tokens, rank 1 has 200: a rank-1 token weighs 5 times a rank-0 token.",
        fix="Sum the per-token losses on each rank and divide by the global token count (all-reduced), or "
        "weight each rank's mean by its token share."),
)
# fmt: on
"""Every check, one row per finding code, in code order: adding a check touches its row, its function
and its tests. Codes are never reused: retire a code by removing its row, never renumber."""

BY_CODE = {spec.code: spec for spec in CHECKS}

CAUSES_FIRST = tuple(spec.code for spec in sorted(CHECKS, key=lambda spec: spec.verdict_rank))
"""Which finding the verdict names when there are several: a cause (a drifted replica, clipping on
scaled gradients) before its consequences (different or wrong coefficients, reference mismatches)."""

CLIPPING_CODES = tuple(spec.code for spec in CHECKS if spec.decides_clipping)
"""The checks that must all have run before the verdict may call clipping right."""


def run_checks(inputs: Analysis, options: AuditOptions) -> tuple[tuple[Finding, ...], tuple[NotChecked, ...]]:
    """Run every check; findings sorted by (severity, code, ranks, params), not-checked by code."""
    from .valueclip import gate

    findings: list[Finding] = []
    not_checked: list[NotChecked] = []
    by_value = gate(inputs)
    for spec in CHECKS:
        if by_value is not None and spec.norm_clipping:
            not_checked.append(NotChecked(code=spec.code, title=spec.title, reason=by_value))
            continue
        result = spec.apply(inputs, options)
        if isinstance(result, NotChecked):
            not_checked.append(result)
        else:
            findings.extend(result)
    return tuple(sorted(findings, key=lambda f: f.sort_key)), tuple(not_checked)


def explain(code: str) -> str:
    """The text `gradaudit explain CODE` prints."""
    spec = BY_CODE[code.upper()]
    headings = ("What it checks", "Why it matters", "Example", "How to fix it")
    body = "\n\n".join(
        f"{heading}\n" + textwrap.fill(text, width=88, initial_indent="  ", subsequent_indent="  ")
        for heading, text in zip(headings, (spec.what, spec.why, spec.example, spec.fix), strict=True)
    )
    return f"{spec.code} ({spec.severity.value}): {spec.title}\n\n{body}\n"


def explain_all() -> str:
    """One line per code: code, severity, title."""
    return "".join(f"{spec.code}  {spec.severity.value:<7}  {spec.title}\n" for spec in CHECKS)
