"""Findings as data: repro/registry.py fixes each comparison, repro/findings.py decides it from the kept logs by one rule
and writes the docs; the docs and the logs on main agree with it."""

import gzip
import json
import math
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "repro"))
import findings  # noqa: E402
import registry  # noqa: E402


def test_the_rule_is_the_student_t_interval_of_the_paired_differences():
    """d = 0.1, 0.2, 0.3: mean 0.2, sd 0.1, half-width t(0.975, 2) 0.1 / sqrt(3) = 4.303 x 0.0577 = 0.248: the
    interval [-0.048, 0.448] holds 0; at that spread 4 seeds resolve it (3.182 x 0.1 / 2 = 0.159 < 0.2)."""
    d = findings.decide([0.1, 0.2, 0.3])
    assert (d.n, d.verdict, d.needed) == (3, "not resolved", 4)
    assert d.mean == pytest.approx(0.2) and d.sd == pytest.approx(0.1) and d.half == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert findings.decide([0.1, 0.12, 0.14]).verdict == "above"  # half-width 4.303 x 0.02 / sqrt(3) = 0.050 < 0.12
    assert findings.decide([-0.3, -0.31]).verdict == "below"  # 12.706 x 0.0071 / sqrt(2) = 0.064 < 0.305
    assert findings.decide([0.05]).verdict == "not resolved"  # one seed: no interval
    assert findings.decide([0.1, -0.1]).needed is None  # a mean of 0: no number of seeds resolves it


def test_an_embedded_finding_holds_reverses_or_is_unresolved_against_its_smollm2_counterpart():
    above, below, open_ = (findings.decide(d) for d in ([0.1, 0.12, 0.14], [-0.1, -0.12, -0.14], [0.1, -0.1, 0.05]))
    assert findings.across(above, above) == "holds" and findings.across(below, below) == "holds"
    assert findings.across(above, below) == "reverses"
    assert findings.across(above, open_) == "unresolved"
    assert findings.across(None, open_) == "SmolLM2 only: unresolved" and findings.across(above, None) == "embedded only: resolved"


def test_the_docs_and_the_logs_on_main_agree_with_the_registry():
    """`python repro/findings.py --check`: the README's findings table and each finding's table in repro/README.md are
    what it writes, every kept log is claimed by an arm or excluded with a reason, every pair shares its code and CPU
    or says why not."""
    assert findings.check() == []


def test_each_readme_cell_is_short():
    for line in findings.readme_table().splitlines()[2:]:
        for cell in line.strip("|").split("|"):
            assert len(cell.split()) <= 45, cell


def kept_log(path, rows, done):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + json.dumps(done) + "\n"
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())


def test_a_finding_is_read_from_the_logs_seed_by_seed_and_a_log_no_arm_claims_is_named(tmp_path, monkeypatch):
    a = registry.Arm("python grpo.py --lr 1 --seed {seed}", "x/a_s{seed}.jsonl.gz")
    b = registry.Arm("python grpo.py --seed {seed}", "x/b_s{seed}.jsonl")
    f = registry.Finding("t", "A against B", "a against b", registry.Comparison(a, b, (0, 1, 2), "today"), "not asked")
    monkeypatch.setattr(findings, "LOGS", tmp_path)
    monkeypatch.setattr(findings, "FINDINGS", [f])
    monkeypatch.setattr(findings, "EXCLUDED", {"y/*": "a probe"})
    here = {"code": "abc1234", "cpu": "Intel(R) Xeon(R) Processor (AVX512)"}
    for seed, (va, vb) in enumerate([(0.5, 0.3), (0.6, 0.35)]):  # seed 2 not run yet
        kept_log(tmp_path / f"x/a_s{seed}.jsonl.gz", [{"step": 0, "eval/pass@1": 0.1}, {"step": 1, "loss": 0.0},
                                                      {"step": 10, "eval/pass@1": va}], here)
        kept_log(tmp_path / f"x/b_s{seed}.jsonl", [{"step": 0, "eval/pass@1": 0.1}, {"step": 10, "eval/pass@1": vb}],
                 here if seed == 0 else {**here, "code": "def5678"})
    kept_log(tmp_path / "y/probe_s0.jsonl", [{"step": 0}], {})
    table = findings.tabulate(f.embedded)
    assert table.decision.n == 2 and table.decision.mean == pytest.approx(0.225)
    assert table.runs[2] == (None, None) and table.unpaired == [1]  # seed 1's runs ran other code
    block = findings.finding_block(f)
    assert "| 0 | 0.500 | 0.300 | 0.200 | abc1234, Intel Xeon | abc1234, Intel Xeon |" in block
    assert "Not yet run: seed 2." in block and "no reason registered" in block
    assert findings.unclaimed() == []
    kept_log(tmp_path / "x/c_s0.jsonl", [{"step": 0}], {})
    assert findings.unclaimed() == ["x/c_s0.jsonl"]


def test_check_names_a_hand_edited_table(monkeypatch, tmp_path):
    readme = findings.README.read_text()
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace(findings.TABLE_END, "| a row written by hand |\n" + findings.TABLE_END))
    monkeypatch.setattr(findings, "README", edited)
    problems = findings.check()
    assert any(p.startswith("README.md: its findings table differs from what `python repro/findings.py` writes (line ")
               and "| a row written by hand |" in p for p in problems), problems


def test_check_names_a_reading_written_before_the_runs_its_tables_now_have(monkeypatch, tmp_path):
    """A reading is stamped with the seeds it read ('Reading (6 embedded, 4 SmolLM2 seeds): ...'): a run landing after
    it makes --check fail until the reading is read again, and a finding with no reading fails too."""
    repro = findings.REPRO_README.read_text()
    k4 = next(f for f in findings.FINDINGS if f.key == "k4")
    end, now = findings.markers(k4)[1], findings.basis(k4)
    assert f"{end}\n\nReading ({now}):" in repro  # on main: stamped with what its tables stand on
    n = findings.tables_of(k4)[1].decision.n
    older = now.replace(f"{n} SmolLM2", f"{n - 1} SmolLM2")
    edited = tmp_path / "README.md"
    edited.write_text(repro.replace(f"{end}\n\nReading ({now}):", f"{end}\n\nReading ({older}):", 1))
    monkeypatch.setattr(findings, "REPRO_README", edited)
    assert findings.check() == [f"repro/README.md: the reading under finding k4 was written at '{older}'; its tables "
                                f"now stand on '{now}': read it again against the verdict and restamp it"]
    edited.write_text(repro.replace(f"{end}\n\nReading ({now}):", f"{end}\n\nA paragraph:", 1))
    assert findings.check() == [f"repro/README.md: no reading under finding k4 (a paragraph 'Reading ({now}): ...' "
                                f"after {end})"]
