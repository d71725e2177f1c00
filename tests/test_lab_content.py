"""One convention in every lab, check and glossary: Ψ counts parameters, bytes are k·Ψ with k named.

LAB-GUIDE §4: "Ψ = the number of parameters; bytes are written as 2Ψ, 4Ψ, …" drifted into three
readings (lab 03's "2Ψ bytes per step (fp16)", a check printing "Ψ = <bytes>", lab 09's "DDP 2Ψ per
step" beside lab 02's 2·4Ψ). Here the forms that mix the two are refused wherever a learner reads them:
the notebook sources, the checks' verdicts and the labs' README. Also the cost model's one form
(α + S/B) and sentences once found false.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXTS = sorted((ROOT / "solutions" / "src").glob("*.py")) + sorted((ROOT / "minifsdp" / "labcheck").glob("*.py")) \
    + [ROOT / "labs" / "README.md"]

FORBIDDEN = {
    # "Ψ = 123,456 B" or f"Ψ = {n} bytes": Ψ is a count of parameters, never a byte count
    r"(?<![x×·*]\s)(?<![·*\w])Ψ\s*=\s*(\{[^}]*\}|[\d,._]+)\s*(B|bytes|KiB|MiB|GiB)\b": "Ψ equated with bytes (Ψ is the number of parameters)",
    # communication as a bare 2Ψ / 3Ψ reads as the ZeRO paper's fp16 units beside lab 02's fp32 2·4Ψ: name
    # both factors (2·4Ψ, 3·4Ψ, 2·2Ψ). Memory in fp16 (the paper's "2Ψ of fp16 parameters") is fine.
    r"(?=.*(per step|\bmoves?\b|\bmoved\b|all-reduce|all_reduce|reduce-scatter|all-gather|HYBRID))"
    r".*(?<![·*\d.\w])[23]Ψ": "communication as a bare 2Ψ / 3Ψ: name both factors (2·4Ψ for an fp32 all-reduce)",
    r"S\s*[·*]\s*β": "the cost model is α + S/B in every lab (S bytes, B bytes per second)",
    r"3 decimal digits": "bf16 keeps 8 significant bits to fp32's 24: about 4.8 decimal digits fewer",
    r"default since 2": "torch's checkpoint still defaults to reentrant (non-reentrant is the recommendation)",
}


@pytest.mark.parametrize("pattern, why", FORBIDDEN.items(), ids=list(FORBIDDEN.values()))
def test_no_mixed_conventions(pattern: str, why: str) -> None:
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for p in TEXTS for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(pattern, line)]
    assert not found, f"{why}:\n" + "\n".join(found)


def test_the_patterns_catch_the_old_forms() -> None:
    """The refused forms, as they once stood in the labs, are caught (a test that cannot fail is no test)."""
    old = ["ZeRO moves 2Ψ bytes per step (fp16)", "print(f'Ψ = {psi * 4:,} B')", "HYBRID: 2Ψ/S",
           "* **DDP** (lab 02): whole model on every rank, 2Ψ per step", "3Ψ bytes moved; the peak beside",
           "the glossary's α + S·β", "bf16 has ~3 decimal digits fewer", "PyTorch's default since 2.x"]
    assert all(any(re.search(p, line) for p in FORBIDDEN) for line in old)
    fine = ["Ψ = 1,234 parameters", "2·4Ψ = 9,872 B", "target 2·4Ψ = {2 * 4 * psi:,} B", "4 B x Ψ = {n:,} B",
            "4Ψ in fp32, 2Ψ in bf16", "the `2Ψ + 2Ψ` bytes of fp16 parameters and gradients",
            "DDP moves 2·4Ψ per step", "3·4Ψ per step", "α + S/B", "16Ψ bytes with Adam"]
    assert not any(re.search(p, line) for p in FORBIDDEN for line in fine)
