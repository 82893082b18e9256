"""Every code block of README.md and docs/*.md runs as written.

How each block is run, page by page, in document order, from a fresh folder holding a copy of
sample_dumps/ (the page's folder):
- ```python: `<!-- docs-test: file=NAME -->` before it writes it to NAME for the commands after it;
  `setup=NAME` runs it between the prelude and the epilogue of SETUPS[NAME] (the names the snippet
  uses, then what it must have done), in a folder of its own; with neither, it runs as it is.
- ```sh: every line is a command, run by bash from the page's folder with `gradaudit`, `python` and
  `torchrun` this interpreter's (and this checkout's gradaudit; torchrun on a free port); it exits with
  the status its `# exit N` comment says, 0 without one.
- ```text starting with `$ command`: that command's real output. A line `...` stands for any lines,
  `...` within a line for any text.
- ```json parses. A block without a language is a figure (a folder tree, a diagram): it holds no command.
- `<!-- docs-test: skip (why) -->` leaves a block out, saying why.

README.md's first block is the pair of set-up commands CI relies on: it is compared byte for byte, and
its `gradaudit check` is run (the second command is the test suite itself, run by .ci/run).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
SETUP_COMMANDS = (
    "pip install torch==2.13.0 -e . && gradaudit check sample_dumps/fsdp2_local_clip/step_1\n"
    "pip install -c constraints.txt torch==2.13.0 -e '.[test,integrations]' && pip install -c constraints.txt "
    "--no-deps torchtitan==0.3.0 && python -m pytest -q tests\n"
)
BLOCK_TIMEOUT_S = 300
SHELL_FUNCTIONS = (
    'gradaudit() { "$DOCS_PYTHON" -m gradaudit "$@"; }\n'
    'python() { "$DOCS_PYTHON" "$@"; }\n'
    'torchrun() { "$DOCS_PYTHON" -m torch.distributed.run --standalone "$@"; }\n'
)
EXIT_COMMENT = re.compile(r"#\s*exit (\d+)")
DIRECTIVE = re.compile(r"^\s*<!-- docs-test: (.*?) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    directive: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def option(self, name: str) -> str | None:
        match = re.fullmatch(rf"{name}=(\S+)", self.directive)
        return match.group(1) if match else None


def blocks_of(page: str) -> list[Block]:
    lines = (REPO / page).read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = fence.group(1), fence.group(2), i
        i += 1
        body = []
        while not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        directive = DIRECTIVE.match(before)
        found.append(
            Block(
                page=page,
                line=start + 1,
                lang=lang,
                code="\n".join(body) + "\n",
                directive=directive.group(1) if directive else "",
            )
        )
        i += 1
    return found


def output_matches(expected: str, actual: str) -> bool:
    """`actual` as `expected` shows it: a line `...` is any lines, `...` within a line any text."""
    pattern = []
    for line in expected.rstrip("\n").splitlines():
        line = line.rstrip()
        if line == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append("[^\n]*".join(re.escape(part) for part in line.split("...")) + r"\n")
    text = "".join(line.rstrip() + "\n" for line in actual.splitlines())
    return re.fullmatch("".join(pattern), text) is not None


def _environment(page_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GRADAUDIT_"))}
    env.update(
        DOCS_PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        COLUMNS="100",
        NO_COLOR="1",
        OMP_NUM_THREADS="1",
        TMPDIR=str(page_dir / ".tmp"),
    )
    env.pop("FORCE_COLOR", None)
    (page_dir / ".tmp").mkdir(exist_ok=True)
    return env


def run_command(command: str, page_dir: Path) -> subprocess.CompletedProcess[str]:
    """The command's exit status and its output, stdout and stderr as a terminal interleaves them."""
    return subprocess.run(
        ["bash", "-c", SHELL_FUNCTIONS + command],
        cwd=page_dir,
        env=_environment(page_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )


class PythonSession:
    """One interpreter that runs the python blocks of every page in turn, each in a folder of its own
    (imports are paid once)."""

    def __init__(self, page_dir: Path) -> None:
        self.read_fd, write_fd = os.pipe()
        self.log = open(page_dir / "python-session.log", "w+", encoding="utf-8")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--session", str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=[write_fd],
            cwd=page_dir,
            env=_environment(page_dir),
            text=True,
        )
        os.close(write_fd)
        self.replies = os.fdopen(self.read_fd, encoding="utf-8")

    def run(self, block: Block, setup: str | None, cwd: Path) -> dict:
        request = {"code": block.code, "setup": setup, "where": block.where, "cwd": str(cwd)}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], BLOCK_TIMEOUT_S)
        line = self.replies.readline() if ready else ""
        if not line:
            self.process.kill()
            self.log.seek(0)
            pytest.fail(f"{block.where}: no answer from the python session:\n{self.log.read()[-6000:]}")
        return json.loads(line)

    def log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(encoding="utf-8", errors="replace")[-6000:]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.replies.close()
        self.log.close()


def run_page(page: str, page_dir: Path, session: PythonSession) -> str | None:
    """Run every block of `page` in order; what failed first, or None."""
    shutil.copytree(REPO / "sample_dumps", page_dir / "sample_dumps")
    outputs: dict[str, subprocess.CompletedProcess[str]] = {}
    timings = []
    try:
        for index, block in enumerate(blocks_of(page)):
            started = time.perf_counter()
            if block.directive.startswith("skip"):
                continue
            if page == "README.md" and index == 0:
                continue  # the set-up commands: test_the_readme_starts_with_the_set_up_commands
            if block.lang == "python" and block.option("file"):
                (page_dir / block.option("file")).write_text(block.code, encoding="utf-8")
            elif block.lang == "python":
                reply = session.run(block, block.option("setup"), page_dir / f"block-{block.line}")
                if not reply["ok"]:
                    return f"{block.where} failed:\n{reply['error']}\n{session.log_tail()}"
            elif block.lang == "sh":
                for command in block.code.splitlines():
                    if not command.strip():
                        continue
                    expected = EXIT_COMMENT.search(command)
                    done = run_command(command, page_dir)
                    outputs[command.split("#")[0].strip()] = done
                    if done.returncode != (int(expected.group(1)) if expected else 0):
                        return f"{block.where}: `{command}` exited {done.returncode}:\n{done.stdout[-6000:]}"
            elif block.lang == "text" and block.code.startswith("$ "):
                first, _, expected = block.code.partition("\n")
                command = first[2:].strip()
                done = outputs.get(command) or run_command(command, page_dir)
                if not output_matches(expected, done.stdout):
                    diff = "\n".join(difflib.unified_diff(expected.splitlines(), done.stdout.splitlines()))
                    return f"{block.where}: the output of `{command}` is not what the page shows:\n{diff}"
            timings.append(f"{block.where} {block.lang}: {time.perf_counter() - started:.1f} s")
    finally:
        print("\n".join(timings))  # seen with -s
    return None


def test_every_block_says_how_it_runs():
    setups_used = set()
    for page in PAGES:
        blocks = blocks_of(page)
        for index, block in enumerate(blocks):
            if block.directive.startswith("skip"):
                assert re.fullmatch(r"skip \(.+\)", block.directive), (
                    f"{block.where}: skip says why: skip (...)"
                )
                continue
            assert block.lang in ("python", "sh", "text", "json", ""), f"{block.where}: ```{block.lang}"
            if block.lang == "python":
                file, setup = block.option("file"), block.option("setup")
                assert block.directive == "" or file or setup, f"{block.where}: {block.directive!r}"
                if setup:
                    assert setup in SETUPS, f"{block.where}: no setup {setup!r} in SETUPS"
                    setups_used.add(setup)
                if file:  # a file is written for a command after it
                    later = "".join(b.code for b in blocks[index + 1 :] if b.lang in ("sh", "text"))
                    assert re.search(rf"\b{re.escape(file)}\b", later), f"{block.where}: nothing runs {file}"
            elif block.lang == "":
                assert not re.search(r"^\s*\$ ", block.code, re.M), f"{block.where}: a command needs ```sh"
            elif block.lang == "json":
                text = block.code.strip()
                try:
                    json.loads(text)
                except json.JSONDecodeError:
                    for line in text.splitlines():  # JSON lines, one value each
                        json.loads(line)
            else:
                assert not block.directive, f"{block.where}: {block.directive!r} applies to python blocks"
    assert setups_used == set(SETUPS), f"setups no block uses: {set(SETUPS) - setups_used}"


def test_the_readme_starts_with_the_set_up_commands(tmp_path):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.startswith(f"# gradaudit\n\n```sh\n{SETUP_COMMANDS}```\n")
    assert "**exits 1, by design**" in readme.split("## ", 1)[0]  # the sample has a clipping bug
    shutil.copytree(REPO / "sample_dumps", tmp_path / "sample_dumps")
    first = SETUP_COMMANDS.splitlines()[0].split(" && ")[1]
    done = run_command(first, tmp_path)
    assert done.returncode == 1 and "GA201" in done.stdout, done.stdout


@pytest.fixture(scope="module")
def python_session(tmp_path_factory):
    session = PythonSession(tmp_path_factory.mktemp("python-session"))
    yield session
    session.close()


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_written(page, tmp_path, python_session):
    failure = run_page(page, tmp_path, python_session)
    assert failure is None, failure


def _table(markdown: str, heading: str) -> list[list[str]]:
    section = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def _defines(module: str, name: str) -> bool:
    """Whether `module` (found, not imported: its framework stays unloaded) binds `name` at top level."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        targets = (
            [node.name]
            if isinstance(node, ast.FunctionDef | ast.ClassDef)
            else [t.id for t in node.targets if isinstance(t, ast.Name)]
            if isinstance(node, ast.Assign)
            else []
        )
        if name in targets:
            return True
        if targets == ["__all__"] and name in ast.literal_eval(node.value):  # bound lazily, by __getattr__
            return True
    return False


def test_the_entry_point_table_names_what_exists():
    import gradaudit
    from gradaudit.testing.plugin import MARKER

    rows = _table((REPO / "README.md").read_text(encoding="utf-8"), "Which entry point when")
    assert len(rows) >= 17
    for when, entry, imports, line in rows:
        code, imported = line.strip("`"), imports.strip("`")
        if imported == "(the command line)":
            assert code.startswith("gradaudit check "), (when, code)
            continue
        body = code + ("\n    pass" if code.endswith(":") else "")
        if code.startswith("@"):
            body += "\ndef test(): pass"
        ast.parse(body)  # one line of real code
        if imported.startswith("from "):
            module, name = re.fullmatch(r"from (\S+) import (\w+)", imported).groups()
            assert _defines(module, name), f"{module} has no {name}"
            assert re.search(rf"\b{name}\(", code), f"{when}: {code} does not use {name}"
            assert module.rsplit(".", 1)[1] in entry, f"{when}: {entry} is not {module}"
        elif imported == "import gradaudit":
            name = re.search(r"gradaudit\.(\w+)\(", code).group(1)
            assert name in gradaudit.__all__ and f"gradaudit.{name}" in entry, (when, code)
        else:
            assert imported == "import pytest" and code.startswith(f"@pytest.mark.{MARKER}("), (when, code)


def test_the_finding_code_table_is_the_registry():
    from gradaudit.checks.registry import CHECKS

    rows = _table((REPO / "README.md").read_text(encoding="utf-8"), "Finding codes")
    assert [(code, severity) for code, severity, _ in rows] == [
        (spec.code, spec.severity.value) for spec in sorted(CHECKS, key=lambda spec: spec.code)
    ]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_and_anchor_resolves():
    for page in [*PAGES, "CHANGELOG.md"]:
        text = (REPO / page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (REPO / page).parent / path if path else REPO / page
            assert file.exists(), f"{page}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{page}: {target}"


# -- what the python blocks with setup= run between ----------------------------------------------------

TINY = """
import torch

import gradaudit

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
"""

ACCELERATOR = """
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

AcceleratorState._reset_state(True)  # a fresh Accelerator per block, as in a fresh process
GradientState._reset_state()
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def loss_fn(out):
    return out.pow(2).mean()
"""

HF = """
import torch
from accelerate.state import AcceleratorState, GradientState
from transformers import Trainer, TrainingArguments

AcceleratorState._reset_state(True)
GradientState._reset_state()


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


torch.manual_seed(0)
model = Regressor()
data = [{"x": 10 * torch.randn(8), "labels": torch.randn(2)} for _ in range(16)]
"""

LIGHTNING = """
import lightning.pytorch as L
import torch


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def training_step(self, batch, index):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


module = Module()
"""

TORCHTITAN = """
import types

import torch
from torchtitan.distributed import utils as dist_utils


class Trainer:
    # Stands in for torchtitan's Trainer, whose data sets and tokenizers cannot be installed here: the
    # attributes gradaudit uses, and a train_step that clips with torchtitan's own clip_grad_norm_.
    def __init__(self, config):
        torch.manual_seed(0)
        self.config = config
        self.model_parts = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))]
        self.optimizers = torch.optim.SGD(self.model_parts[0].parameters(), lr=0.01)
        self.parallel_dims = types.SimpleNamespace(get_optional_mesh=lambda name: None)
        self.step = 0

    def train_step(self, batch):
        self.model_parts[0](batch).pow(2).mean().backward()
        params = [p for part in self.model_parts for p in part.parameters()]
        dist_utils.clip_grad_norm_(params, self.config.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
        self.optimizers.step()
        self.optimizers.zero_grad()

    def train(self):
        batch = 10 * torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        while self.step < self.config.training.steps:
            self.step += 1
            self.train_step(batch)
"""

CLEAN_STEP = """
code, report = check("audit/step_{step}")
assert code == 0 and report["ranks"][0]["reported_norm"] is not None, report
"""

SETUPS: dict[str, tuple[str, str]] = {
    # README, troubleshooting GA204: without the holder the guard says GA204 and GA302; with it, nothing.
    "outside-parameter": (
        TINY
        + """
temperature = torch.nn.Parameter(torch.tensor(5.0))  # trained and clipped, but not in the model
params = [*model.parameters(), temperature]
opt = torch.optim.SGD(params, lr=0.1)


def train(steps):
    for _ in range(steps):
        (model(torch.randn(4, 8) * 10) * temperature).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()


bare = gradaudit.guard(model, max_norm=1.0, optimizer=opt, out_dir="bare")
train(1)
bare.remove()
assert [codes for _, codes in bare.anomalies] == [("GA204", "GA302")], bare.anomalies
""",
        """
(guard,) = attached(gradaudit.Guard)
train(2)
guard.remove()
assert guard.anomalies == [] and [line["verdict"] for line in trend("audit")] == ["ok", "ok"]
""",
    ),
    "capture-loop": (
        TINY
        + "opt = torch.optim.SGD(model.parameters(), lr=0.01)\nbatch = 10 * torch.randn(4, 8)\nnum_steps = 200\n",
        """
assert sorted(os.listdir("audit")) == ["step_100", "step_200"], os.listdir("audit")
"""
        + CLEAN_STEP.format(step=100)
        + CLEAN_STEP.format(step=200),
    ),
    "begin-audit": (
        TINY
        + """
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batch = 10 * torch.randn(4, 8)


class Trainer:  # a framework's loop, with a clip method gradaudit does not know
    def clip_gradients(self, parameters, max_norm):
        grads = [p.grad for p in parameters]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in grads:
            g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def training_step(self, batch):
        model(batch).pow(2).sum().backward()
        self.clip_gradients(list(model.parameters()), 1.0)
        opt.step()


trainer = Trainer()
""",
        CLEAN_STEP.format(step=3) + 'assert report["ranks"][0]["applied_clip_coef"] < 1, report\n',
    ),
    "dump": (TINY + "batch = 10 * torch.randn(4, 8)\nstep = 5\n", CLEAN_STEP.format(step=5)),
    "accelerate": (
        ACCELERATOR
        + "loader = torch.utils.data.DataLoader(10 * torch.randn(200 * 4, 8), batch_size=4)  # 100 steps\n",
        'assert os.listdir("audit") == ["step_100"]\n' + CLEAN_STEP.format(step=100),
    ),
    "accelerate-guard": (
        ACCELERATOR
        + """
loader = torch.utils.data.DataLoader(10 * torch.randn(4 * 2 * 4, 8), batch_size=4)  # 4 steps
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
""",
        """
(guard,) = attached(Guard)
for batch in loader:
    with accelerator.accumulate(model):
        accelerator.backward(loss_fn(model(batch)))
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
guard.remove()
assert guard.anomalies == [] and [line["verdict"] for line in trend("audit")] == ["ok"] * 4
""",
    ),
    "hf": (HF, 'assert os.listdir("audit") == ["step_100"]\n' + CLEAN_STEP.format(step=100)),
    "hf-guard": (
        HF
        + """
args = TrainingArguments(output_dir="out", max_steps=3, max_grad_norm=1.0, logging_steps=1, report_to=[])
trainer = Trainer(model=model, args=args, train_dataset=data)
""",
        """
trainer.train()
logged = [entry for entry in trainer.state.log_history if "loss" in entry]  # each step's log call
assert [entry["step"] for entry in logged] == [1, 2, 3], trainer.state.log_history
assert all(abs(entry["gradaudit_reported_over_true"] - 1) < 1e-3 for entry in logged), logged
assert [line["verdict"] for line in trend("audit")] == ["ok"] * 3
""",
    ),
    "lightning": (
        LIGHTNING + "loader = torch.utils.data.DataLoader(10 * torch.randn(100 * 4, 8), batch_size=4)\n",
        'assert os.listdir("audit") == ["step_100"]\n' + CLEAN_STEP.format(step=100),
    ),
    "lightning-guard": (
        LIGHTNING + "loader = torch.utils.data.DataLoader(10 * torch.randn(3 * 4, 8), batch_size=4)\n",
        """
assert "gradaudit/true_norm" in trainer.callback_metrics, trainer.callback_metrics
assert [line["verdict"] for line in trend("audit")] == ["ok"] * 3
""",
    ),
    "torchtitan": (
        TORCHTITAN
        + "config = types.SimpleNamespace(training=types.SimpleNamespace(max_norm=1.0, steps=100))\n",
        'assert os.listdir("audit") == ["step_100"]\n' + CLEAN_STEP.format(step=100),
    ),
    "torchtitan-guard": (
        TORCHTITAN
        + """
config = types.SimpleNamespace(training=types.SimpleNamespace(max_norm=1.0, steps=3))
trainer = Trainer(config)
""",
        """
trainer.train()
(attached_guard,) = attached(TorchtitanGuard)
attached_guard.remove()
assert attached_guard.guard.anomalies == [] and [line["verdict"] for line in trend("audit")] == ["ok"] * 3
""",
    ),
    "deepspeed-guard": (
        """
import os
import socket

import deepspeed
import torch
import torch.distributed as dist

if not dist.is_initialized():  # a process group of one rank, as torchrun's environment gives
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
""",
        """
(attached_guard,) = attached(DeepSpeedGuard)
for _ in range(3):
    x, y = 10 * torch.randn(4, 8), torch.randn(4, 4)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
attached_guard.remove()
assert attached_guard.guard.anomalies == [] and [line["verdict"] for line in trend("audit")] == ["ok"] * 3
""",
    ),
}

SESSION_HELPERS = """
import contextlib
import gc
import io
import json
import os

from gradaudit.live.guard import Guard


def attached(kind):
    found = [o for o in gc.get_objects() if issubclass(type(o), kind)]  # type(): no __class__ lookups
    return [o for o in found if getattr(o, "active", getattr(getattr(o, "guard", None), "active", False))]


def check(path):
    from gradaudit.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["check", path, "--format", "json"])
        except SystemExit as exited:
            return exited.code, json.loads(out.getvalue() or "null")
    raise AssertionError("gradaudit check returned without an exit code")


def trend(out_dir):
    with open(os.path.join(out_dir, "guard_trend.jsonl"), encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]
"""


def _session(reply_fd: int) -> None:
    """The python session's side: run each block it is sent, and answer whether it ran."""
    replies = os.fdopen(reply_fd, "w", encoding="utf-8")
    home = os.getcwd()
    for request in sys.stdin:
        block = json.loads(request)
        print(f"== {block['where']} (setup {block['setup']})", flush=True)
        os.makedirs(block["cwd"], exist_ok=True)
        os.chdir(block["cwd"])
        namespace: dict = {"__name__": "__docs__"}
        prelude, epilogue = SETUPS[block["setup"]] if block["setup"] else ("", "")
        error = None
        try:
            for name, code in (("helpers", SESSION_HELPERS), ("prelude", prelude)):
                exec(compile(code, f"<{name} of {block['where']}>", "exec"), namespace)
            exec(compile(block["code"], block["where"], "exec"), namespace)
            exec(compile(epilogue, f"<epilogue of {block['where']}>", "exec"), namespace)
        except BaseException:
            error = traceback.format_exc()
        finally:
            guards = sys.modules.get("gradaudit.live.guard")
            for guard in list(guards._ATTACHED.values()) if guards else ():
                guard.remove()  # a guard left attached would see the next block's clip calls
            os.chdir(home)
        replies.write(json.dumps({"ok": error is None, "error": error}) + "\n")
        replies.flush()


if __name__ == "__main__" and sys.argv[1:2] == ["--session"]:
    _session(int(sys.argv[2]))
