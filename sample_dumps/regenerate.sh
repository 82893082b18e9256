#!/usr/bin/env bash
# Rebuild every sample dump with `gradaudit demo`, then the golden Markdown reports of them in
# tests/golden_samples/. Review the diff before committing: the dumps are the README's examples.
set -euo pipefail
cd "$(dirname "$0")/.."
scenarios=$(python -c 'from gradaudit.demo import scenario_names; print(" ".join(scenario_names()))')
for scenario in $scenarios; do
    rm -rf "sample_dumps/$scenario"
    gradaudit demo "$scenario" sample_dumps
done
python -m pytest -q tests/render/test_samples_golden.py --update-goldens
