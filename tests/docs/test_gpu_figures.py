"""Every GPU figure in the README and the docs says what it was measured on: its GPU and its commit.

- A docs section a benchmark writes on a GPU (a name ending in ``_cuda``, or a body naming an NVIDIA GPU) starts
  with the line that ``benchmarks/cuda_slices.py`` stamps on it (``*Measured on GPU ... at commit C, DATE ...*``,
  ``commit unknown`` where no commit could be found), or says it has not run on a GPU yet.
- Outside those sections, a paragraph or bullet that names a GPU (NVIDIA, H100, H200, A100) and quotes a figure
  names the commit it was measured at (``commit 919b471``, ``commits 919b471, 74da06e``, ``commit unknown``); a
  README headline about the GPU's step names the device it was measured on (a GPU, or the CPU).
- The table of GPU slices on ``docs/benchmarks/index.md`` and the GPU statuses of the feature pages (the
  Triton kernels, the CUDA graph step, AMP's scaler on the device's path, the interleaved offload schedule,
  DeepSpeed on CUDA, ...) are what ``benchmarks/cuda_slices.py render`` writes from the state file: each page
  says whether the feature has run on a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import cuda_slices as S
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
GPU = re.compile(r"\b(NVIDIA|H100|H200|A100)\b")
COMMIT = re.compile(r"\bcommits? ([0-9a-f]{7,40}|unknown)\b")
# a figure: a decimal, or a number with a unit of time, speed, size or ratio
FIGURE = re.compile(r"\d+\.\d+|\b\d+ ?(ms|us|s|x|%|GB/s|GiB|MiB|bytes)\b")
NOT_YET = "not yet run on a gpu"


def gpu_sections(text: str) -> dict[str, str]:
    """The sections of a page written on a GPU: named ``*_cuda``, or naming an NVIDIA GPU in their body (the
    sections written from the state file aside)."""
    return {name: body for name, body in S.sections(text).items()
            if not (name == "cuda_slices" or name.startswith("gpu_status_"))
            and (name.endswith("_cuda") or "NVIDIA" in body)}


def unlabeled_sections(text: str) -> list[str]:
    """The GPU sections of a page that neither start with a stamp naming a GPU and a commit nor say they have not
    run on a GPU yet."""
    bad = []
    for name, body in gpu_sections(text).items():
        stamp = S.STAMP.match(body)
        if stamp is not None:
            if not GPU.search(stamp.group(0)) or not COMMIT.search(stamp.group(0)):  # a dry run's stamp is no GPU's
                bad.append(name)
        elif NOT_YET not in body.lower():
            bad.append(name)
    return bad


def blocks(text: str) -> list[str]:
    """The page's prose outside code and outside its GPU sections: paragraphs, each bullet apart, table rows apart."""
    for name in gpu_sections(text):
        text = re.sub(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->", "", text, flags=re.S)
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", FENCE.sub("", text)):
        first = True
        for line in paragraph.splitlines():
            if line.strip().startswith("<!--"):
                continue
            if first or line.startswith(("- ", "|")):
                out.append(line.strip())
                first = False
            else:
                out[-1] += " " + line.strip()
    return [b for b in out if b]


def unlabeled_figures(text: str) -> list[str]:
    """The blocks that name a GPU and quote a figure but name no commit."""
    return [b for b in blocks(text)
            if GPU.search(b) and FIGURE.search(re.sub(r"`[^`]*`", "", b)) and not COMMIT.search(b)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_gpu_section_names_its_gpu_and_commit(page: Path) -> None:
    bad = unlabeled_sections(page.read_text())
    assert not bad, (f"{page.relative_to(ROOT)}: the GPU sections {bad} do not start with the line naming the GPU and "
                     "the commit (*Measured on NVIDIA ... at commit C, DATE.*) nor say 'Not yet run on a GPU'")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_gpu_figure_names_its_commit(page: Path) -> None:
    bad = unlabeled_figures(page.read_text())
    assert not bad, (f"{page.relative_to(ROOT)}: these name a GPU and quote a figure but name no commit (`git log -S` "
                     f"on the figure finds the one that added it; else 'commit unknown'): {[b[:120] for b in bad]}")


def test_the_readmes_gpu_headlines_name_their_device() -> None:
    text = S.sections((ROOT / "README.md").read_text())["headline"]
    items = [line for line in text.splitlines() if line.startswith("- ") and re.search(r"GPU|CUDA|Triton", line)]
    assert items, "the README's headline figures name no GPU figure"
    for item in items:
        assert GPU.search(item) or "on the CPU" in item, f"this headline names no device: {item[:100]}"


def test_the_slice_table_and_the_gpu_statuses_are_the_state_files() -> None:
    state = S.load_state(ROOT)
    expected = [(S.INDEX, "cuda_slices", S.slices_table(state))]
    expected += [(f.page, f"gpu_status_{f.key}", S.feature_text(f, state)) for f in S.FEATURES]
    for page, name, body in expected:
        text = (ROOT / "docs" / page).read_text()
        assert S.replace_section(text, name, body) == text, (
            f"docs/{page}, section {name}: not what the state file says; run python benchmarks/cuda_slices.py render")
        assert name == "cuda_slices" or re.search(r"(ran|ran in part|not yet run) on a GPU", body), body
    assert not any(e.get("dry_run") for e in state.values()), "the state file holds a dry run's entries"


def test_the_checks_catch_an_unlabeled_figure() -> None:
    # the checkers' own parts on known input
    stamped = ("<!-- a_cuda:start -->\n*Measured on NVIDIA H100 80GB HBM3 at commit 0123abc, 2026-01-01.*\n\nx\n"
               "<!-- a_cuda:end -->")
    assert unlabeled_sections(stamped) == []
    assert unlabeled_sections("<!-- b_cuda:start -->\nMachine: NVIDIA H100, 1.9 ms\n<!-- b_cuda:end -->") == ["b_cuda"]
    assert unlabeled_sections("<!-- c_cuda:start -->\nNot yet run on a GPU (slice `x`).\n<!-- c_cuda:end -->") == []
    text = ("Intro.\n\n- **On an H100:** `int8` in 1.9 ms\n- **On an H100** (commit 0123abc): 2.5 ms\n\n"
            "Measured on one NVIDIA H200,\nthe step 3.4 ms.\n\nThe `h100-pcie5` profile predicts 891 ms.\n")
    assert unlabeled_figures(text) == ["- **On an H100:** `int8` in 1.9 ms",
                                       "Measured on one NVIDIA H200, the step 3.4 ms."]
