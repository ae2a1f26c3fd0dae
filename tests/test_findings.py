"""The findings page, written from the recorded data (data/): what it says must follow the data."""

import html
import re


def test_findings_page_reads_the_recorded_runs(root, tmp_path, monkeypatch):
    from dflash_lab import findings

    monkeypatch.chdir(root)     # write_findings changes into the project root
    out = findings.write_findings(root, tmp_path)
    text = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<img[^>]*>", "", out.read_text())))
    text = re.sub(r"\s+", " ", text)
    # the first wrong value comes from the stock probe that reached 32 requests (it ends in NaN), not from the
    # low-concurrency stock probe whose engine name shares its prefix and whose file sorts first
    assert "First wrong value (step probe, one run at concurrency 32" in text
    assert "The first 480-token replay (step 273, 30 requests) is NaN in 480 rows, the reference pass in 0." in text
    assert "Stock probed at lower concurrency too (2 probe log(s), up to 16 requests per step): 556 of 556 FULL steps " \
           "diverge, first at L8 gdn, no NaN." in text
    assert "986 of 986 FULL-graph steps identical to the no-graph pass" in text
    assert ("FULL_AND_PIECEWISE (FA3 splits 1 for the drafter only) at concurrency 32: 3 / 3 crashed (predicted: crash; "
            "core dump: copy_and_expand_dflash_inputs_kernel)") in text
    assert "Every decided prediction held" in text
    assert "4/4 requests identical to the PIECEWISE reference" in text and "not attributed" not in text
    # s19: the offline counts stay offline, the server path has its own line with what its clients saw
    assert "offline engine) dies on a CUDA fault" in text and "at concurrency 32: 15/15 crashed" in text
    # s20-s21: every other concurrency with its own count; s21's plain 16 joined the hooked runs
    assert "at other concurrencies, 1: 0/3 crashed" in text and "8: 3/3 crashed" in text
    assert "16: 0/6 crashed (0/3 with core dump on (keep running); 0/3 with launch hook)" in text
    assert "24: 4/4 crashed (3/3 with core dump on; 1/1 plain)" in text
    # s21: not monotonic, and the acceptance-8.8 runs counted apart, never pooled with 1.86
    assert ("Not monotonic in concurrency in the runs so far: 8 (s20) crashed where 12 (s21), 16 (s21, a session before "
            "labels) completed (never in one GPU session).") in text
    assert "the first draft position was accepted in 100% of drafts, so no step rejected every draft" in text
    assert ("Where offline stock crashes every run, the fix completed 14/14 at concurrency 32, 3/3 at concurrency 64; at "
            "2, 16 stock completes too") in text and "the fix has not run at 8, 20, 24, 28, where stock crashes" in text
    assert "At synthetic acceptance 8.8 (the report's crash A acceptance), stock offline TP=1: concurrency 16: 0/3 crashed" in text
    # the fix's runs at 16 are where stock completes: said once, in the sentence that sets each fix concurrency beside stock
    assert "concurrency 16: 3/3 completed" in text and "stock completed there too" not in text
    assert "concurrency 64: 3/3 completed," in text or "concurrency 64: 3/3 completed;" in text
    assert "in 3 of 3 crashes whose process outlived the core dump, the engine log shows both asserts failing, after the DFlash" in text
    assert "The OpenAI server at TP=1" in text and "concurrency 32: 5/5 crashed" in text and '"code": 500' in text
    assert "FA3 splits 1 for the target only) at concurrency 32: 0 / 3 crashed" in text
    assert "defined only in the drafter's compiled graph (vLLM compile tag eagle_head)" in text


def test_findings_page_without_probe_logs(root, tmp_path, monkeypatch):
    """The run lines alone (no data/gpu: no probe logs, engine logs or reproducer runs) still give a page."""
    import shutil

    from dflash_lab import findings

    shutil.copytree(root / "data" / "runs", tmp_path / "data" / "runs")
    monkeypatch.chdir(tmp_path)
    out = findings.write_findings(tmp_path, tmp_path / "out")
    text = out.read_text()
    assert "First wrong value" not in text and "Workaround today" in text
    assert "The OpenAI server at TP=1" in text   # the server's line needs the run lines only
