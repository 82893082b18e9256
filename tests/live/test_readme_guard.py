"""The README's quickstart is the guard (for anyone who does not know which step to audit), and
its loop runs as written: the guard attached in one line, every step checked and found right."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

import gradaudit
from gradaudit.live.trend import TREND_FILE

README = Path(__file__).resolve().parents[2] / "README.md"


def _guard_section() -> str:
    text = README.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    assert sections[1].startswith("Quickstart: guard every step\n"), (
        "the README's first section is not the guard"
    )
    return sections[1]


def test_the_readmes_first_section_is_the_guard_and_its_loop_runs_as_written(tmp_path, monkeypatch):
    (loop,) = re.findall(r"```python\n(.*?)```", _guard_section(), flags=re.DOTALL)[:1]
    assert "gradaudit.guard(model, max_norm=1.0, optimizer=opt" in loop
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    attached = []
    real = gradaudit.guard
    monkeypatch.setattr(gradaudit, "guard", lambda *a, **kw: attached.append(real(*a, **kw)) or attached[-1])
    monkeypatch.chdir(tmp_path)
    try:
        exec(
            loop,
            {
                "torch": torch,
                "model": model,
                "opt": torch.optim.SGD(model.parameters(), lr=0.1),
                "loader": [torch.randn(4, 8) * 10 for _ in range(3)],
                "loss_fn": lambda out: out.pow(2).sum(),
            },
        )
    finally:
        for guard in attached:
            guard.remove()
    (guard,) = attached
    lines = [json.loads(line) for line in (tmp_path / "audit" / TREND_FILE).read_text().splitlines()]
    assert [(line["step"], line["verdict"]) for line in lines] == [(1, "ok"), (2, "ok"), (3, "ok")]
    assert all(line["true_norm"] > 1.0 for line in lines)  # every step clipped, and rightly
    assert guard.anomalies == [] and not guard.active
    # the integrations the section names exist
    for name in (
        "lightning_guard",
        "transformers_guard",
        "accelerate_guard",
        "deepspeed_guard",
        "torchtitan_guard",
    ):
        assert (
            f"{name}." in _guard_section()
            and (Path(gradaudit.__file__).parent / "integrations" / f"{name}.py").exists()
        )
