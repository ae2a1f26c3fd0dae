"""The findings page, written from the recorded data (data/): what it says must follow the data."""

import html
import re

import pytest


def test_findings_page_reads_the_recorded_runs(root, tmp_path, monkeypatch):
    from dflash_lab import findings

    monkeypatch.chdir(root)     # write_findings changes into the project root
    out = findings.write_findings(root, tmp_path)
    # a bold topic is inline: its tags go without a space, every other tag becomes one
    text = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<img[^>]*>|</?b>", "", out.read_text())))
    text = re.sub(r"\s+", " ", text)
    # the first wrong value comes from the stock probe that reached 32 requests (it ends in NaN), not from the
    # low-concurrency stock probe whose engine name shares its prefix and whose file sorts first
    assert "First wrong value (step probe, one run at concurrency 32" in text
    assert "The first 480-token replay (step 273, 30 requests) is NaN in 480 rows, the reference pass in 0." in text
    # s22 added stock probes at 8 and 12: the one at 8 wrote NaN on its first FULL step, and its crash step has no
    # comparison; s35 probed 8 again (the same steps) and 64 twice, whose FULL steps hold at most 30 requests
    # s51 probed 24 (probe-c24-tp1): NaN from the first FULL step after a request finished, and no crash; s52's second
    # run at 24 crashed at its first row-0 step; s53's probe-hang-c24-tp1 had s51's run's events at the same steps, and
    # s54's two calls of it: one cut at step 226, one again through step 295
    # s56's fourth attempt at probe-hang-c24 adds one log (its ledger run is another configuration: scheduler ledger);
    # s58's three planned runs of it add three (two stopped after step 295, one crashed at 281 with 22 NaN requests)
    assert ("Stock probed with fewer requests per FULL step too (16 probe log(s), concurrency 2, 8, 12, 16, 24, 64): 3929 of "
            "3931 FULL steps diverge (the other 2: a crash step, whose pass ended in a CUDA error before the comparison), "
            "each log first at L8 gdn; NaN in 12 of them: at concurrency 8 (s22) from step 3 (its first FULL step), NaN rows "
            "graph / reference 32 / 0 (8 req, 128 tokens); then GDN accepted counts of 0 on 174 steps, in batch rows above 0 "
            "until step 273, which put one in row 0 (the crash step: the GDN kernel reads state column -1, before the index "
            "tensor in row 0); at concurrency 8 (s35) from step 3") in text
    assert ("at concurrency 64 (s35) from step 280 (its first FULL step), NaN rows graph / reference 480 / 0 (30 req, 480 "
            "tokens)") in text and "at 2, 12, 16 finite on every FULL step." in text
    # s54's first call was cut by the runner's deadline at step 226, before the step (275) where the other logs at 24
    # went NaN: named apart, not counted as a log finite on every FULL step at 24
    assert ("at concurrency 24 (s54) finite up to its last step 226, before step 275 where the other logs at 24 went "
            "NaN; at 2, 12, 16 finite") in text
    assert "1265 of 1265 FULL-graph steps identical to the no-graph pass" in text
    # s36's attention-output taps: why the replays are wrong and some turn NaN (the tap probes are counted apart)
    assert ("Why (attention-output taps, s36): group 7's graphs read its buffer as last written, [128, 0, 31, 0, 1, 0, 0, "
            "0, 2] then zeros on every stale read these taps recorded, a 1-request batch's FA3 schedule; decoded for b "
            "requests it gives no split") in text
    assert ("the requests left unwritten were those predicted from the recorded schedule on 1398 of 1398 FULL steps (5 "
            "engines, concurrency 8, 16, 32)") in text
    assert "in 3 of 3 probed engines: those rows kept NaN" in text
    assert ("stock completed 3 of 3 where plain-tap stock crashed 3 of 3 (concurrency 8, 32, one session), outputs still "
            "wrong: consistent with the crash needing that NaN, not decided") in text
    # the pre-registered tests of that (s37 at 8 and 16, s38 at 32): group 7's outputs alone pre-filled, every outcome
    # as predicted; the exact test keeps sessions apart (s38's stale schedules held other padding)
    assert ("(probe-fill-tp1 and probe-fill32-tp1 and probe-fill20-tp1 and probe-early-tp1 and probe-early2-tp1, s37, s38, "
            "s41, s42, s45, every engine under the step probe: group 7's attention outputs alone pre-filled before FA3 runs, "
            "each outcome predicted in the matrix before the run): 35 of 35 runs with a prediction ended as predicted; with "
            "NaN there stock crashed 9 of 9 (concurrency 8, 16, 20, 28, 32); with 0 or the sentinel it completed 14 of 14 "
            "(concurrency 8, 20, 28, 32), 3928 of 3928 FULL steps still differing") in text
    assert "without a pre-fill stock completed 2 of 10 (concurrency 16, 20, 28)" in text
    assert "fix 2 with the same NaN completed 2 of 2 with 0 FULL steps differing" in text
    # s41 at 20, s42 at 20 and 28 (probe-early2-tp1 repeating them): the plain-tap runs crashed too (predicted: untapped
    # stock crashes there), after NaN of their own; over every plain-tap probe the first site moved (s44 at 28, s45 at
    # 20), each site with how many requests the engine's first step admitted, and s46's admission gate set that count
    assert ("At 8, 16, 20, 28, 32 (TP=1, offline) the crash follows the NaN in the rows FA3 leaves unwritten: within each "
            "session and concurrency every NaN-filled stock run crashed and every 0- or sentinel-filled one completed; the "
            "8 other crashes had no pre-fill, and NaN of their own in the requests FA3 left unwritten before they died (at "
            "20, 5 runs, first at step 10 in L15 attn; at 28, 3 runs, first at step 11 in L23 attn; what a probed engine's "
            "graph memory held there; over every stock engine probed with plain taps, any matrix (14 at 20, 20 at 28), the "
            "first site moved: at 20, 1 run(s) at step 10, L15 attn, requests [10, 12, 13, 15, 17, 18] (s45; ledger on; "
            "ids replaced: others; first step admitted 7 requests) and 13 run(s) at step 10, L15 attn, requests [10, 12, "
            "15, 17] (s41, s42, s43, s44, s45; ledger off, ledger on; ids replaced: all, none, others, row0; first step "
            "admitted 1, 2, 3, 4 requests); at 28, 2 run(s) at step 10, L23 attn, requests [14, 15, 16, 17, 18, 19, 20, "
            "21, 22, 23, 24, 25, 26, 27] (s46; ledger on; ids replaced: none; first step admitted 28 requests, set by the "
            "admission gate in 2) and 7 run(s) at step 10, L23 attn, requests [14, 17, 21, 24] (s44, s46; ledger off, "
            "ledger on; ids replaced: none, others; first step admitted 3, 7 requests, set by the admission gate in 5) and "
            "11 run(s) at step 11, L23 attn, requests [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27] (s42, s43, "
            "s44, s45, s46; ledger off, ledger on; ids replaced: all, none, row0; first step admitted 1, 2 requests, set "
            "by the admission gate in 4)) (s37 at 8: 2 crashes in 5 "
            "runs; s37 at 16: 2 crashes in 4 runs; s38 at 32: 2 crashes in 6 runs; s41 at 20: 2 crashes in 4 runs, 1 "
            "NaN-filled; s42 at 20: 3 crashes in 3 runs, 0 NaN-filled; s42 at 28: 4 crashes in 6 runs, 1 NaN-filled; s45 "
            "at 20: 2 crashes in 4 runs, 1 NaN-filled), 1 in 5400 if the pre-fill did not matter") in text
    # s46: the first step's admissions set by the gate, the pre-registered sites at 28 (probe-admit-tp1)
    assert ("Tested (probe-admit-tp1, pre-registered, s46, at 28): with the engine's first step set to admit K requests "
            "once all had arrived (dflash_lab/admit.py; the probe recorded K in the first step and the rest in the second "
            "in 11 of 11 runs), 9 of 9 runs with a prediction ended as predicted (2 predicted conditions, each repeated: "
            "close replicas of one seeded workload); K=1: first NaN at step 11 in 4 run(s); "
            "K=7: first NaN at step 10 in 5 run(s); K=28: first NaN at step 10 in 2 run(s), with no prediction, every run "
            "crashing at its first row-0 step.") in text
    # s38's build ledger: who wrote the stale schedule, and the padding that differs between sessions
    assert ("Who wrote it (probe-builds-tp1, s38, the probe's build ledger, 1 stock and 1 fixed engine(s) at 16): 4 of 4 "
            "predictions written before the run held ((a), (b), (c), (d)); group 7's builder built 32 times before the "
            "first served step, the FULL captures from 32 requests down to 1") in text
    # the padding follows the build ledger, not the session (s39 and s40 each ran both settings; probe-padding-tp1)
    assert ("held [0, 31, 0, 0, 0, 0, 0, 0, 0] in every stock tap probe with the build ledger off (s36, s37, s39, s40, 20 "
            "probes); all 0x7fff7fff in every stock tap probe with the build ledger on (s38, s39, s40, s41, s42, s45, 28 probes); with a "
            "sentinel pre-filled, group 7 left unwritten, on FULL steps of 8 requests, requests [1, 2, 3, 4, 5, 6, 7] in "
            "s37 (ledger off); requests [4, 5, 6, 7] in s38 (ledger on); requests [1, 2, 3, 4, 5, 6, 7] in s39 (ledger "
            "off); requests [4, 5, 6, 7] in s39 (ledger on); requests [1, 2, 3, 4, 5, 6, 7] in s40 (ledger off); requests "
            "[4, 5, 6, 7] in s40 (ledger on)") in text
    # the unprobed engines' snapshot (s39, s40): the crashing engines hold the ledger-off padding
    assert ("The build ledger tested, and the unprobed engines' schedule (probe-padding-tp1, s39, s40, 11 runs: 6 probed, "
            "5 with only a host copy of each FA3 schedule when the first served step began): 29 of 29 checks held as "
            "predicted before the run; in each of s39 and s40, alternating, the padding followed the ledger setting (off: "
            "s36's and s37's, 3 of 3 runs; on: s38's, 3 of 3): the ledger, not the session, most plausibly set s38's") in text
    assert ("untapped stock crashed 2 of 2 at 8, 3 of 3 at 32, and group 7 held the padding [0, 31, 0, 0, 0, 0, 0, 0, "
            "0] in each at its first served step (schedule snapshot on)") in text
    assert "whose replays the sentinel runs (s36, s37, s39, s40) showed" in text
    # the same engines with core dumps (s40, snap-coredump-tp1): which kernel faults where the schedule was recorded
    assert ("With core dumps (snap-coredump-tp1, s40, 4 untapped stock runs with the snapshot): 12 of 12 checks held as "
            "predicted before the run; every run crashed, group 7 held [128, 0, 31, 0, 1, 0, 0, 0, 2] at the first served "
            "step in each, and the cores named at 32 copy_and_expand_dflash_inputs_kernel 2 of 2; at 8 "
            "fused_sigmoid_gating_delta_rule_update_kernel 2 of 2.") in text
    assert "matrices/probe-fill-tp1.yaml is the test" not in text
    # s35's split-1 probe completed: the page must not let "0 / 1 crashed" read as "right"
    assert ("Not a workaround: FA3 with one split per graph (attention_config flash_attn_max_num_splits_for_cuda_graph=1) "
            "completes, but its FULL replays are wrong (281 of 283 FULL steps diverged") in text
    assert ("Under the step probe, FA3 splits 1 on both sides completed (1 run(s) at concurrency 32, s35), but 281 of its "
            "283 FULL steps diverged from the no-graph pass, first at L8 gdn, none with NaN") in text
    assert ("the step probe with the fix (4 engine(s), concurrency 2, 8, 16, 32, 64, up to 32 requests per FULL step): the "
            "target's outputs on all 1676 FULL-graph steps identical") in text
    assert ("FULL_AND_PIECEWISE (FA3 splits 1 for the drafter only) at concurrency 32: 3 / 3 crashed (predicted: crash; "
            "core dump: copy_and_expand_dflash_inputs_kernel)") in text
    assert "notebook 03): every decided prediction held" in text
    assert "4/4 requests identical to the PIECEWISE reference" in text and "not attributed" not in text
    # s19: the offline counts stay offline, the server path has its own line with what its clients saw
    assert "offline engine) dies on a CUDA fault" in text and "at concurrency 32: 23/23 crashed" in text
    # s20-s21: every other concurrency with its own count; s21's plain 16 joined the hooked runs
    assert "at other concurrencies, 1: 0/3 crashed" in text and "8: 11/11 crashed" in text
    assert "16: 0/8 crashed (0/3 with core dump on (keep running); 0/3 with launch hook; 0/2 plain)" in text
    assert "6: 0/1 crashed (0/1 plain)" in text and "10: 0/1 crashed (0/1 plain)" in text
    # s49's and s50's stock controls beside the upstream diff added one keep-running crash each at 24, 28 and 64 per
    # session, and the repeat at 24 (stock-c24-core-tp1, s50 and s51) two more at 24; s52's hang-env-c24-tp1 one more
    # with core dump on (abort mode), and its second run in s53 another
    assert ("24: 10/10 crashed (3/3 with core dump on; 4/4 with core dump on (keep running); 2/2 with core dump on, hang "
            "snapshot; 1/1 plain)") in text
    assert "28: 6/6 crashed (3/3 with core dump on; 2/2 with core dump on (keep running); 1/1 plain)" in text
    assert "64: 5/5 crashed (3/3 with core dump on (keep running); 2/2 plain)" in text
    assert ("Offline at 64, 24 and 28, where stock crashes every run (GPU sessions 2026-12-03-s49, 2026-12-03-s50; each "
            "session ran its stock controls first): stock controls crashed 6/6 (at 64 (s49): "
            "copy_and_expand_dflash_inputs_kernel; at 24 (s49): no core file, its engine log printed 2 failed device "
            "asserts, the drafter's RoPE position bounds; at 28 (s49): copy_and_expand_dflash_inputs_kernel; at 64 (s50): "
            "copy_and_expand_dflash_inputs_kernel; at 24 (s50): copy_and_expand_dflash_inputs_kernel; at 28 (s50): "
            "copy_and_expand_dflash_inputs_kernel); with the diff 3/3 at 64, 3/3 at 24, 3/3 at 28 completed (one engine "
            "start, in that order, 2026-12-03-s49), 0 of 9 counting below the schedule") in text
    assert ("under the step probe at 64 (2026-12-03-s50): runs ok 1/1; 0 of 280 FULL steps diverging (up to 29 requests), "
            "largest difference 0.0, first NaN step none, 0 canary violations. Of its 11 predictions written before the "
            "runs, 10 of 11 decided held; failed as written: (a) stock control at 24 (s49); 2 of 2 integrity checks "
            "held.") in text and "not run yet: (c)" not in text
    # s21: not monotonic, and the acceptance-8.8 runs counted apart, never pooled with 1.86
    # s22 ran 8, 10, 12 and 16 in one session
    assert ("Not monotonic in concurrency in the runs so far: 8 (s20, s22, s39, s40, s47) crashed where 10 (s22), 12 (s21, s22), 16 (s21, "
            "s22, a session before labels) completed (each of these concurrencies also ran in GPU session s22).") in text
    assert "the first draft position was accepted in 100% of drafts, so no step rejected every draft" in text
    # TP=1's: at TP=2 stock crashed at 16 (s27), where the fix has not run
    assert ("Where offline TP=1 stock crashes every run, the fix (TP=1) completed 3/3 at concurrency 8, 3/3 at concurrency 20, "
            "3/3 at concurrency 24, 3/3 at concurrency 28, 14/14 at concurrency 32, 3/3 at concurrency 64; at 2, 16 TP=1 stock "
            "completes too") in text and "the fix has not run at" not in text
    assert ("Part 1 alone there: 3/3 at concurrency 8 (s22, whose stock control crashed), 3/3 at concurrency 20 (s22, whose "
            "stock control crashed), 3/3 at concurrency 32 (s16, whose stock control crashed).") in text
    # s22: the c8 control's core names the target's GDN kernel and its log has no RoPE assert; s40's two at 8 and s47's
    # control (beside the upstream diff) the same; s47's controls at 32 and 20 printed both; s49's at 64, 24 (no core
    # file) and 28 printed both, and so did s50's controls and both runs of the repeat at 24 (s50, s51), and s57's
    # crash at 24 under the ledger, and s58's two crashes at 24 (probe-hang-c24's r1, probe-hang-ledger2's r1), and
    # s62's two under the admission gate (K=4, K=1)
    assert ("in 22 of 26 crashes whose process outlived the core dump, the engine log shows both asserts failing") in text
    assert "; the 4 at concurrency 8 whose cores name fused_sigmoid_gating_delta_rule_update_kernel printed none" in text
    assert text.count("whose core names fused_sigmoid_gating") + text.count("whose cores name fused_sigmoid_gating") == 1
    assert "At synthetic acceptance 8.8 (the report's crash A acceptance), stock offline TP=1: concurrency 16: 0/3 crashed" in text
    # the fix's runs at 16 are where stock completes: said once, in the sentence that sets each fix concurrency beside stock
    assert "concurrency 16: 3/3 completed" in text and "stock completed there too" not in text
    assert "concurrency 64: 3/3 completed," in text or "concurrency 64: 3/3 completed;" in text
    assert "The OpenAI server at TP=1" in text and "concurrency 32: 6/6 crashed" in text and '"code": 500' in text
    # s48: stock servers at 8 and 20 beside the upstream diff's, and the clients' statuses in numeric order
    assert "concurrency 8: 1/1 crashed (1/1 with core dump on)" in text and "HTTP 200 x8, 200 x20, 200 x32 and then" in text
    assert ("On the OpenAI server, the report's path (GPU session 2026-12-03-s48; 10 of 10 predictions written before the "
            "runs held, and 2 of 2 integrity checks): stock servers crashed 3/3") in text
    assert ("the diff's server completed 10/10 at 32, 3/3 at 8, 3/3 at 20 (one server start, in that order), every request "
            "HTTP 200 with all its tokens; at synthetic acceptance 6.0 and concurrency 8 the diff counted 6.000, 6.000, "
            "6.000 tokens per step, stock 5.120, 5.108, 5.108") in text
    assert "FA3 splits 1 for the target only) at concurrency 32: 0 / 3 crashed" in text
    assert "defined only in the drafter's compiled graph (vLLM compile tag eagle_head)" in text
    # s43: the sampler's out-of-vocabulary ids, probe-oor-tp1 and the row-0 rule
    # 47 since s56's two probed runs at 24 (the fourth probe-hang-c24 attempt and the ledger run), 50 since s57's three
    # that reached step 275 (its first call's run was cut at step 12 and is one of the 48 others), 54 since s58's four,
    # 55 since s59's probe-admit-c24 run (cut by the runner's deadline after NaN logits from step 275 on), 58 since s62's
    # three runs of it, 59 since s72's K=2 run of it
    assert ("From the NaN to the illegal address (s43): in every one of the 59 probed runs whose verify logits held NaN "
            "the rejection sampler returned an id equal to the vocabulary size") in text
    assert "the GDN accepted counts of 0 were exactly those requests, the step after" in text
    assert ("with those ids replaced by token 0 after sampling, 4 of 4 runs at 20, 28 completed with NaN logits to the "
            "end and no count of 0, and the same session's stock control crashed 1 of 1; 5 of 5 predictions held") in text
    assert "24 of the 24 crashing probe logs ended at the first step in which batch row 0 held" in text
    assert "while rows above 0 held such requests on 1522 earlier steps without a fault." in text
    # s44: the row-0 rule tested (probe-oor-row0-tp1), and the first NaN site at 28 no longer one site
    assert ("Tested (probe-oor-row0-tp1, pre-registered, s44): 4 of 4 runs ended as predicted. With the ids replaced "
            "in rows above 0 only, each run crashed at the first step row 0's own id was out of vocabulary (step 16 and "
            "23 at 20 and 28). With row 0's replaced only, the replacement gave row 0 its only token on 74 and 75 steps, "
            "first at step 16 and 23 (at 20 and 28), and the run went on; rows above 0 went without a token on 1204 "
            "and 2015 request-steps before it crashed") in text
    assert "after 2 and 9 earlier changes of row 0's request (finished requests) to requests with a token." in text
    assert "the first site moved: at 20, 1 run(s) at step 10, L15 attn" in text
    # s45: each row-0 entry's kernel observed with core dumps (probe-oor-core-tp1), the GDN crash step read through
    # its s44 replica, and the others run's step not the header's
    assert ("Core dumps at each entry (probe-oor-core-tp1, pre-registered, s45): 2 of 2 runs faulted in the kernel and batch row "
            "predicted: a count of 0 "
            "moved into row 0 (at 20): fused_sigmoid_gating_delta_rule_update_kernel, the focused block in batch row 0 of "
            "17, in the step after the record's last line (499; the dump stopped the process inside the target's forward, "
            "most likely the probe's no-graph reference pass") in text
    assert ("which the s44 replica, identical on steps 4-498, recorded as the move, with 17 requests (the launch's 17 "
            "sequences are not the last line's 18 requests: the launch is not that step's); row 0's own "
            "out-of-vocabulary id (at 20): copy_and_expand_dflash_inputs_kernel, the focused block in batch row 0 of 20, "
            "at the run's first row-0 step (14; not the step the header named, its s44 replica's 16") in text
    # s51: a probed run at 24 went past its first row-0 step without a fault (probe-c24-tp1), and the page says so
    # s53, s54 and s56 (twice: the fourth probe-hang-c24 attempt and the ledger run) repeated s51's run: said once; s57's
    # ledger2 runs added two more that passed and one crash at its row-0 step (285)
    # s58: two more such runs (probe-hang-c24's r0 and r2); sessions in number order; s62: the gate's K=3 run, and its
    # K=4 and K=1 runs two more crashing logs; s72: the gate's K=2 run
    assert ("Not every row-0 step faults: in s51, s53, s54, s56 (2 runs), s57 (2 runs), s58 (2 runs), s62 and s72 11 probed "
            "runs"
            " at 24 (neither crashed nor completed) each had their first row-0 step at 281 (their own "
            "out-of-vocabulary id) and recorded 14 more steps without a fault. 52 of the 53 crashing probe logs ended"
            " at their first row-0 step and 1 one step before it (a GDN-kernel core stopped the process before the "
            "probe wrote the step; its replica shows the move), but not every row-0 step crashed.") in text
    # s56-s58: why they stop, from the hang snapshot's judged runs (s58: all three planned runs) and the scheduler ledger
    assert ("Why they stop (probe-hang-c24-tp1, pre-registered): the 3 runs its rule judges stopped (83, 78, 93 s "
            "after their last step, 295) read GPU utilization 0/0/0 %, and the dumps taken in 2 of them held no CUDA "
            "kernel, contradicting the prediction of a kernel that does not end.") in text
    assert ("A scheduler ledger in one more run (probe-hang-ledger-c24-tp1, its predictions not judged: 53 s without a "
            "step, below its 60 s rule) recorded no token scheduled for 40 s on end with 3 requests running, each at 511 "
            "of 512 output tokens and held by vLLM's async max_tokens guard with 16, 16, 64 output placeholders and no "
            "step in flight") in text
    # s57-s58: the ledger matrix under pre-registered (e)-(g): r0 three times (s57), r1 once (s58), every prediction held;
    # s58: the probes' attention lengths say the leaked computed tokens do not move the runner's positions
    assert ("Pre-registered again (probe-hang-ledger2-c24-tp1): of its 4 measured runs (r0 3 times, r1 once), 2 "
            "crashed (2 at their first row-0 step (285), core triton_poi_fused_2) and 2 stopped after step 295 (63 s "
            "and 71 s without a step); in each stop the 3 requests running were held by the max_tokens guard with "
            "placeholders 16 times their updates that returned no token, and those updates came exactly at the "
            "probe's steps where the request's first sampled id was out of vocabulary; the dump taken in the stop: no"
            " CUDA kernel; vLLM 0.22.1's own AsyncScheduler, run on the CPU (dflash_lab.asyncsched) with those counts"
            " and each request's last empty row on its final step, ends in the ledgers' state, request for request "
            "(output, computed tokens, placeholders), and never schedules them again; the leaked computed tokens stay"
            " in the scheduler: of the 288 out-of-vocabulary rows of the 13 probed runs at 24, the 232 followed by a "
            "later step of the same request left its attention length unmoved to that step, and between any other two"
            " steps it moved 1-16 tokens (a runner placing tokens by the leaked count would move it by more than 1 + "
            "k somewhere); 6 of its 6 predictions held.") in text
    # s58: the runs at 24 by trajectory (read afterwards); s62: the admission test's K=4, K=1 and K=3 runs held; s72:
    # its K=2 run, so every prediction held
    assert ("Read afterwards (s58): the 13 probed runs at 24 that reached NaN logits followed 3 trajectories, each "
            "named by the set of requests and steps whose first sampled id was out of vocabulary, each number of "
            "requests the engine's first step admitted (left to arrival timing offline) went with one trajectory, and"
            " each trajectory with one kind of ending: a first step of 2 or 3 requests: trajectory 49d3f971, no step "
            "recorded after 295 (9 of 9: 6 timeouts, 3 deadline cuts; a cut is not a judged stop), request 16's own "
            "id in row 0 at step 281 without a fault; a first step of 1 request: trajectory b24b6dcf, a crash at its "
            "first row-0 step, 285, with request 17's own id in row 0 (3 of 3); a first step of 4 requests: "
            "trajectory 18c2a7fd, a crash at its first row-0 step, 281, with request 16's own id in row 0 (1 of 1). "
            "The admission gate's test (probe-admit-c24-tp1, pre-registered): 5 of 5 predictions held, 0 failed, 0 "
            "undecided (held: (0) every run, (1) K=1, (2) K=2, (2) K=3, (3) K=4); 1 run(s) cut by "
            "the runner's deadline, not judged: K=4, last recorded step 281 (first step 4 of 24; its out-of-vocabulary "
            "ids up to there were trajectory 18c2a7fd's).") in text


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


def test_the_findings_count_the_benchmark_stock_server_crashes():
    from dflash_lab import findings

    text = findings._bench_stock_clause(".")
    assert "concurrency 8: 3/3 (1 a warm-up) crashed" in text and "concurrency 1: 0/9 (6 a warm-up) crashed" in text
    # 16: s26's and s31's 7 runs and s34's 4 (a full-length warm-up and 3 measured runs)
    assert "concurrency 16: 0/11 (5 a warm-up) crashed" in text and "concurrency 64: 1/1 crashed" in text
    assert "112/112/112/368/368/336 scheduled tokens" in text and "device-side assert triggered" in text
    # one segment per acceptance: s30's stock runs at 3.6 and 6.0 crashed nowhere but lost tokens at 8 (and 32, 64)
    six = text[text.index("at synthetic acceptance 6 (s30"):]
    assert "concurrency 32: 0/6 crashed" in six and "concurrency 64: 0/3 crashed" in six
    assert "7 of its 29 completed runs counted below the schedule's 6: 5 at 8 (5.107, 5.108, 5.108, 5.320, 5.320)" in six
    assert "at synthetic acceptance 1.86 (s26, s30, s31, s34; 18 with core dump on;" in text and "concurrency 32: 2/2 crashed" in text
    three = text[text.index("at synthetic acceptance 3.6 (s30, s31"):text.index("at synthetic acceptance 6 (s30")]
    assert "8 of its 29 completed runs counted below the schedule's 3.6: 5 at 8 (2.685, 2.690, 2.718, 2.856, 2.909)" in three


def test_no_benchmark_no_stock_clause(tmp_path):
    from dflash_lab import findings

    assert findings._bench_stock_clause(tmp_path) == ""


def _tp2_inputs(df):
    from dflash_lab import analysis, crashstates

    sa = analysis.stock_full(df)
    sa = sa[~sa.apply(analysis.is_deadline_cut, axis=1)]
    tp1 = sa[(sa["mode"].fillna("offline") == "offline") & (sa["tensor_parallel_size"] == 1)]
    return sa, crashstates.rank_faults(df), tp1


def test_the_findings_state_tp2_beside_tp1_s27():
    from dflash_lab import analysis, findings

    df = analysis.load_runs()
    text = findings._tp2_clause(df, *_tp2_inputs(df))
    assert "concurrency 16: 3/3 crashed (TP=1: 0/8)" in text and "concurrency 32: 1/5 crashed (TP=1: 23/23)" in text
    assert "(2 x NVIDIA H200; " in text
    assert "core dumps name copy_and_expand_dflash_inputs_kernel (1), triton_poi_fused_3 (3)" in text
    assert "in 4 of 4 every rank's core names the same kernel" in text
    assert "Worker_TP0's 2 times, Worker_TP1's 2 times" in text
    assert ("The PIECEWISE control at TP=2: not run yet; the fix at TP=2: not run yet; "
            "the server at TP=2: not run yet.") in text


def test_tp2_clause_with_a_crash_without_core_and_controls_per_concurrency():
    """A stock crash whose core dump failed, a TP=2 run without a crash, PIECEWISE and fix runs: no error, and each
    control counted per path and concurrency."""
    import pandas as pd
    from dflash_lab import analysis, findings

    df = analysis.load_runs()
    base = df[df["run_id"] == "tp2-stock/c16/r0"].iloc[0].to_dict()
    rows = [dict(base, run_id="s/c16/r9", fault=None),
            dict(base, run_id="pw/c16/r0", cudagraph_mode="PIECEWISE", outcome="ok", crashed=False, fault=None),
            dict(base, run_id="pw/c32/r0", cudagraph_mode="PIECEWISE", outcome="ok", crashed=False, fault=None, concurrency=32),
            dict(base, run_id="fix/c16/r0", fix=True, outcome="ok", crashed=False, fault=None)]
    d = pd.DataFrame(rows)
    text = findings._tp2_clause(d, *_tp2_inputs(d))
    assert "concurrency 16: 1/1 crashed" in text and "no core dump (1)" in text and "in 0 of 1 every rank's" in text
    assert "triton_poi_fused_3:" not in text
    assert "DFlash PIECEWISE at TP=2, offline: concurrency 16: 0/1 crashed" in text and "concurrency 32: 0/1 crashed" in text
    assert "with the fix at TP=2, offline: concurrency 16: 0/1 crashed" in text
    # TP=2 stock runs that all completed: no crash part, nothing empty printed
    ok = pd.DataFrame([dict(base, run_id="s/c16/r8", outcome="ok", crashed=False, fault=None)])
    text = findings._tp2_clause(ok, *_tp2_inputs(ok))
    assert "concurrency 16: 0/1 crashed" in text and "core dumps name" not in text and "()" not in text


def test_no_tp2_runs_no_tp2_clause():
    from dflash_lab import analysis, findings

    df = analysis.load_runs()
    df = df[df["tensor_parallel_size"] == 1]
    assert findings._tp2_clause(df, *_tp2_inputs(df)) == ""


def test_a_tie_says_which_mode_leads_on_the_mean():
    from dflash_lab.findings import _margin_text

    one = {"runner-up": "no speculation", "modes": ["DFlash FULL (fixed)"], "margin over runner-up": "1.94-2.44x"}
    assert _margin_text(one) == ", 1.94-2.44x over no speculation"
    tie = {"runner-up": "DFlash FULL (fixed)", "modes": ["DFlash FULL (fixed)", "no speculation"],
           "margin over runner-up": "1.17x"}
    assert _margin_text(tie) == ", no speculation ahead on the mean by 1.17x"
    flips = dict(tie, **{"runner-up": "DFlash FULL (fixed) / no speculation"})
    assert _margin_text(flips) == ", the lead on the mean changing within the range"
    assert _margin_text({"runner-up": None, "modes": ["no speculation"], "margin over runner-up": "-"}) == ""


def test_the_speed_line_names_the_recorded_6_0_tie_and_its_leader(root, monkeypatch):
    from dflash_lab import findings

    monkeypatch.chdir(root)
    runs = findings._bench_runs(".")
    if runs is None or 6.0 not in set(runs["acceptance"]):
        pytest.skip("no 6.0 bench slice recorded")
    text = findings.bench_line(".", runs)
    assert ("synthetic acceptance 6, GPU session 2026-12-01-s29" in text
            and "concurrency 64: DFlash FULL (fixed) or no speculation (tie within the spread), no speculation ahead on "
                "the mean by 1.17x" in text)
    assert "exactly L at an integer L" in text
    # the choice leaves out the runs that compiled a Triton kernel, as the speedups quoted in the README do: with
    # them, s24's fixed FULL at 16 (one of its 3 runs compiled fused_moe_kernel) read as a tie with PIECEWISE, and
    # s30's at 6.0 and 16 likewise
    assert "without the runs that compiled a Triton kernel" in text
    assert ("GPU session 2026-12-01-s24 (chosen among DFlash FULL (fixed), DFlash PIECEWISE; measured in another session: "
            "DFlash FULL (stock), DFlash eager, no speculation): concurrency 1-16: DFlash FULL (fixed), 1.09-1.87x over "
            "DFlash PIECEWISE") in text
    assert "concurrency 1-16: DFlash FULL (fixed), 1.29-2.30x over no speculation / DFlash PIECEWISE" in text


def test_the_page_opens_with_the_workaround_and_the_speed_table(root, tmp_path, monkeypatch):
    from dflash_lab import findings

    monkeypatch.chdir(root)
    page = findings.write_findings(root, tmp_path).read_text()
    head = page[page.index("<h2>Workaround, and the speed to expect</h2>"):page.index("<h2>Summary</h2>")]
    assert "<p><b>Workaround today</b>: cudagraph_mode=PIECEWISE" in head
    rows = [re.sub(r"<[^>]+>", "|", r) for r in head.split("<tr>")[2:]]
    assert len(rows) >= 4 and all("x (" in r for r in rows)
    # s29, acceptance 6.0: fixed FULL over no speculation at 1, and the queued 64 cell starred
    six = next(r for r in rows if "|DFlash FULL (fixed)||6||s29|" in r)
    assert "|1.94x (1.84-2.11)|" in six and "|0.85x (0.73-1.05)*|" in six
    assert "it ran at most 49 at once" in head and "Workaround today" not in page[page.index("<h2>Summary</h2>"):]
    # the summary reads top down: the crash and its cause first, the benchmark's per-session detail last
    items = re.findall(r"<li>(.*?)</li>", page[page.index("<h2>Summary</h2>"):page.index("<h2>Evidence")], re.S)
    leads = [next(lead for lead in findings.SUMMARY_ORDER if html.unescape(re.sub(r"<[^>]+>", "", i)).startswith(lead))
             for i in items]
    assert leads == list(findings.SUMMARY_ORDER)


def test_the_stock_clause_reads_the_counters_of_the_crashed_runs(root, monkeypatch):
    from dflash_lab import findings

    monkeypatch.chdir(root)
    text = findings._bench_stock_clause(".")
    # s26's three at 8 and s30's at 32 counted below the schedule; s31's at 32 and 64 counted it (-1.0, -0.3)
    assert ("acceptance counters over those crashed runs read 1.15, 1.12, 1.12, 1.86, 1.86, 1.84 against the synthetic "
            "schedule's 1.86, -94 to -0.3 of the schedule's standard errors; 4 of 6 below the schedule (at concurrency "
            "8, 32): the sampler accepts whatever the token") in text
    assert "-0 " not in text


def test_the_counted_clause_at_an_integer_acceptance_has_no_spread_and_still_judges():
    import pandas as pd

    from dflash_lab.findings import _counted_clause

    run = lambda acc, L, n=1000: {"outcome": "crash", "run_id": f"s/c8/{acc}", "mode": "DFlash FULL (stock)",
                                  "concurrency": 8, "acceptance": acc, "num_speculative_tokens": 15,
                                  "acceptance_length": L, "num_drafts": n, "gpu_session": "S"}
    six = _counted_clause(pd.DataFrame([run(6.0, 5.2)]))
    assert "5.20 against the synthetic schedule's 6" in six and "nan" not in six and "standard errors" not in six
    assert "lost tokens after sampling" in six
    both = _counted_clause(pd.DataFrame([run(1.86, 1.12, 1956), run(6.0, 5.2)]))
    assert "1.12 against the synthetic schedule's 1.86; 5.20 against the synthetic schedule's 6" in both
    assert "(1 at an integer acceptance, where the schedule has no spread)" in both and "lost tokens" in both
    assert "lost tokens" not in _counted_clause(pd.DataFrame([run(6.0, 6.0)]))
    assert _counted_clause(pd.DataFrame([run(1.86, None)])) == ""


def test_the_counted_clause_says_which_crashed_runs_fell_below():
    """s31: crashed runs that counted the schedule beside ones that fell below it; the clause names the concurrencies
    below instead of saying every run lost tokens, and a gap under one standard error keeps its decimal."""
    import pandas as pd

    from dflash_lab.findings import _counted_clause, _signed

    run = lambda c, L, n: {"outcome": "crash", "run_id": f"s/c{c}/r0", "mode": "DFlash FULL (stock)", "concurrency": c,
                           "acceptance": 1.86, "num_speculative_tokens": 15, "acceptance_length": L, "num_drafts": n,
                           "gpu_session": "S"}
    mixed = _counted_clause(pd.DataFrame([run(8, 1.12, 1956), run(64, 1.859, 13527)]))
    assert "1 of 2 below the schedule (at concurrency 8)" in mixed and "the others counted it" in mixed
    assert "to -0.3 of the schedule's standard errors" in mixed
    assert "1 of" not in _counted_clause(pd.DataFrame([run(8, 1.12, 1956)]))
    assert (_signed(-93.9), _signed(-0.3), _signed(0.04), _signed(12.4)) == ("-94", "-0.3", "+0.0", "+12")


def test_the_glance_section_says_when_there_is_nothing_to_show():
    from dflash_lab.findings import glance_html

    assert "not measured yet" in glance_html(None)


def test_the_workaround_line_says_stock_loses_tokens_where_it_does_not_crash(root, monkeypatch, tmp_path):
    """s30 at 6.0, concurrency 8: stock FULL's 3 runs counted 5.107-5.108 where fixed FULL and PIECEWISE counted 6."""
    from dflash_lab import bench, findings

    monkeypatch.chdir(root)
    runs = bench.load_bench("data/bench/*.jsonl")
    text = findings._stock_loss_clause(runs)
    assert ("at synthetic acceptance 6 and concurrency 8 (s30) every stock run (3) counted 5.107-5.108 tokens per step "
            "against the schedule's 6, where DFlash FULL (fixed) and DFlash PIECEWISE counted it in every run") in text
    # without a same-session reference that counted the schedule, nothing is claimed
    assert findings._stock_loss_clause(runs[runs["mode"] == "DFlash FULL (stock)"]) == ""
    assert findings._stock_loss_clause(None) == "" and findings._stock_loss_clause(runs.iloc[0:0]) == ""
    page = findings.write_findings(root, tmp_path / "out").read_text()
    assert "Stock FULL graphs are no choice where they do not crash either" in page


def test_prefill_clause_says_when_an_outcome_missed_its_prediction(monkeypatch):
    import pandas as pd

    from dflash_lab import divergence, findings, verification

    def row(fill, fix, c, predicted, outcome):
        return {"gpu_session": "2026-12-01-s37", "pre-fill": fill, "fix": fix, "concurrency": c, "predicted": predicted,
                "outcome": outcome, "steps differing": 0 if fix else 279, "FULL steps with taps": 279}

    table = pd.DataFrame([row("nan", False, 16, "crash", "crash"), row("zero", False, 8, "ok", "crash"),
                          row("nan", True, 16, "ok", "ok"), row("none", False, 16, "ok", "ok")])
    monkeypatch.setattr(verification, "of_matrix", lambda probes, df, m: pd.DataFrame({"path": ["p"]}))
    monkeypatch.setattr(verification, "tapped", lambda pt: pt)
    monkeypatch.setattr(divergence, "load_probe", lambda path: {})
    monkeypatch.setattr(verification, "fill_table", lambda df, probes: table)
    clause = lambda: findings._prefill_clause(pd.DataFrame(), pd.DataFrame())  # noqa: E731
    text = clause()
    assert "3 of 4 runs with a prediction ended as predicted" in text and "with 0 or the sentinel it completed 0 of 1" in text
    assert "Not every outcome held its prediction" in text and "1 in" not in text
    table.loc[1, "outcome"] = "ok"
    text = clause()
    # the fix run is no stratum member (it completes whatever the fill): 1 crash in stock's 2 runs at 16
    assert "s37 at 16: 1 crash in 2 runs), 1 in 2 if the pre-fill did not matter" in text and "Not every" not in text
    # every prediction held but nothing crashed (zero and fix runs only): no test, and no false "not every outcome held"
    table.loc[0, ["pre-fill", "predicted", "outcome"]] = ["zero", "ok", "ok"]
    text = clause()
    assert "4 of 4 runs with a prediction ended as predicted" in text and "Not every" not in text and "1 in" not in text
    # a plain-tap stock run where untapped stock's outcome is mixed has no prediction: counted apart, not as a miss
    table.loc[3, "predicted"] = None
    text = clause()
    assert "3 of 3 runs with a prediction ended as predicted (1 had none)" in text and "Not every" not in text
    # a crash without a pre-fill (untapped stock crashes there, so predicted): the exact test still runs, and the clause
    # says whether that run's unwritten rows held NaN of their own before it died (s41's plain taps at 20)
    table = pd.DataFrame([row("nan", False, 20, "crash", "crash"), row("zero", False, 20, "ok", "ok"),
                          row("sentinel", False, 20, "ok", "ok"), row("none", False, 20, "crash", "crash")])
    table["first NaN step"] = [3, None, None, 10]
    table["first NaN layer"] = ["language_model.model.layers.7.self_attn.attn", None, None,
                                "language_model.model.layers.15.self_attn.attn"]
    table["NaN only in unwritten requests"] = [True, None, None, True]
    table["earlier writes finite"] = [True, None, None, True]
    table["NaN requests"] = [list(range(20)), None, None, [10, 12, 15, 17]]
    table["first FULL step"] = [3, 3, 3, 3]
    table["last step"] = [16, 281, 281, 16]
    text = clause()
    assert ("every NaN-filled stock run crashed and every 0- or sentinel-filled one completed; the other crash had no "
            "pre-fill, and NaN of its own in the requests FA3 left unwritten before it died (at 20, 1 run, first at step 10 "
            "in L15 attn;") in text
    assert "s37 at 20: 2 crashes in 4 runs, 1 NaN-filled), 1 in 2 if the pre-fill did not matter" in text
    # without any 0- or sentinel-filled run the clause cannot say they all completed: the neutral ending instead
    saved = table
    table = saved.iloc[[0, 3]].reset_index(drop=True)
    text = clause()
    assert "every 0- or sentinel-filled one completed" not in text and "not shown to have had NaN of their own" in text
    table = saved
    # the same crash with no NaN of its own: not explained, and said so
    table.loc[3, "first NaN step"] = None
    text = clause()
    assert "the crashes were not all NaN-filled runs, and the others are not shown to have had NaN of their own" in text
    assert "every NaN-filled stock run crashed" not in text
    monkeypatch.setattr(verification, "of_matrix", lambda probes, df, m: pd.DataFrame({"path": []}))
    assert clause() == ""


def test_first_sites_text_speaks_only_of_a_concurrency_with_several_sites():
    from dflash_lab import findings

    one = {"site": "step 10, L15 attn", "runs": 2, "sessions": "s41", "ledger": "ledger on", "replaced": "none",
           "first steps": "1, 2"}
    assert findings.first_sites_text({20: [one]}) == ""
    two = dict(one, site="step 11, L23 attn", runs=1, sessions="s44", ledger="ledger off", **{"first steps": "7"})
    assert findings.first_sites_text({20: [one], 28: [one, two]}) == (
        "; over every stock engine probed with plain taps, any matrix (2 at 20, 3 at 28), the first site moved: at 28, "
        "2 run(s) at step 10, L15 attn (s41; ledger on; ids replaced: none; first step admitted 1, 2 requests) and 1 "
        "run(s) at step 11, L23 attn (s44; ledger off; ids replaced: none; first step admitted 7 requests)")


def test_plain_sites_text_names_one_site_or_says_there_are_several():
    import pandas as pd

    from dflash_lab import findings

    sites = pd.DataFrame([{"concurrency": 20, "runs": 4, "sites": 1, "first NaN step": 10,
                           "first NaN layer": "language_model.model.layers.15.self_attn.attn"},
                          {"concurrency": 28, "runs": 1, "sites": 1, "first NaN step": 11,
                           "first NaN layer": "language_model.model.layers.23.self_attn.attn"},
                          {"concurrency": 32, "runs": 2, "sites": 2, "first NaN step": float("nan"), "first NaN layer": None},
                          {"concurrency": 16, "runs": 2, "sites": 1, "first NaN step": float("nan"), "first NaN layer": None}])
    assert findings.plain_sites_text(sites) == ("at 20, 4 runs, first at step 10 in L15 attn; at 28, 1 run, first at "
                                                 "step 11 in L23 attn; at 32, 2 runs at 2 different first sites; at 16, "
                                                 "2 runs, no NaN recorded")


def test_the_server_diff_clause_is_absent_without_its_runs_and_says_when_a_request_was_not_clean():
    from dflash_lab import analysis, findings, verification

    df = analysis.load_runs()
    assert findings._diff_server_line(df[df["matrix"] != verification.DIFF_SERVER_MATRIX]) == ""
    bad = df.copy()
    i = bad.index[(bad["matrix"] == verification.DIFF_SERVER_MATRIX) & (bad["run_id"] == "diff-server/c8/r0")][0]
    bad.at[i, "requests_failed"] = 1
    line = findings._diff_server_line(bad)
    assert "not every request clean (notebook 04)" in line and "9 of 10 predictions" in line


def test_the_trajectory_sentence_reports_the_admission_test_once_it_has_run():
    """Once probe-admit-c24-tp1 has lines, the page gives its verdicts (here four recorded runs relabelled as if the
    gate had set their first step, see test_verification's _admit_c24_case); before, that it has not run."""
    import pandas as pd

    from dflash_lab import analysis, findings, verification as V

    df = analysis.load_runs()
    # s59's call alone (later calls' lines left out): one K=4 run cut by the runner's deadline; said, never judged
    s59 = df[(df["matrix"] != V.ADMIT_C24_MATRIX)
             | df["file"].astype(str).str.contains("2026-12-04_h200_probe-admit-c24-a-tp1")]
    assert findings._trajectory_sentence(s59, "data").endswith(
        "The admission gate's test (probe-admit-c24-tp1, pre-registered): 0 of 5 predictions held, 0 failed, 5 "
        "undecided (undecided: (0) every run, (1) K=1 (not run), (2) K=2 (not run), (2) K=3 (not run), (3) K=4); 1 "
        "run(s) cut by the runner's deadline, not judged: K=4, last recorded step 281 (first step 4 of 24; its "
        "out-of-vocabulary ids up to there were trajectory 18c2a7fd's).")
    df = df[df["matrix"] != V.ADMIT_C24_MATRIX]
    assert findings._trajectory_sentence(df, "data").endswith(
        "The admission gate's test of this (probe-admit-c24-tp1, pre-registered) has not run yet.")
    base = df.copy()
    base["first_step_requests"] = base.get("first_step_requests")

    def relabelled(ks):
        d = base.copy()
        for (part, rid), k in zip((("probe-hang-c24-f-tp1", "r1"), ("probe-hang-ledger2-c24-b-tp1", "r0"),
                                   ("probe-hang-ledger2-c24-c-tp1", "r0"), ("probe-hang-ledger2-c24-d-tp1", "r0")), ks):
            i = d.index[d["file"].astype(str).str.contains(part) & d["run_id"].str.endswith(rid)]
            d.loc[i, ["matrix", "run_id", "first_step_requests"]] = [V.ADMIT_C24_MATRIX, f"stock-admit-k{k}-c24/c24/r0", k]
        return d

    df = relabelled((4, 1, 3, 2))
    text = findings._trajectory_sentence(df, "data")
    assert text.endswith("The admission gate's test (probe-admit-c24-tp1, pre-registered): 5 of 5 predictions held, "
                         "0 failed, 0 undecided (held: (0) every run, (1) K=1, (2) K=2, (2) K=3, (3) K=4).")
    # K=1 and K=4 swapped: the gate's check (0) fails, and so do (1) and (3), each named with what was measured
    text = findings._trajectory_sentence(relabelled((1, 4, 3, 2)), "data")
    assert "0 of 5 predictions held" not in text and "2 of 5 predictions held, 3 failed, 0 undecided (held: (2) K=2, " \
        "(2) K=3; failed: (0) every run, measured " in text
    assert "; (1) K=1, measured K=1: trajectory 18c2a7fd, crash, last step 281" in text
    assert "; (3) K=4, measured K=4: trajectory b24b6dcf, crash, last step 285" in text
    # a line of the matrix that cannot be judged (a run its file does not plan) is said, not passed over
    bad = pd.concat([df, df[df["matrix"] == V.ADMIT_C24_MATRIX].iloc[:1].assign(run_id="stock-admit-k9-c24/c24/r0")])
    assert "could not be judged: probe-admit-c24-tp1: run lines ['stock-admit-k9-c24/c24/r0'] are not among" in \
        findings._trajectory_sentence(bad, "data")


def test_a_summary_item_renders_as_paragraphs_each_opening_topic_in_bold():
    from dflash_lab import findings

    item = ("Root cause: a <stale> schedule." + findings.PARA + "Who wrote it (probe-builds-tp1, s38): the capture."
            + findings.PARA + "Does the crash need that NaN? (five matrices) yes." + findings.PARA
            + "DFlash FULL (fixed) / no speculation, acceptance 6: 2.30x." + findings.PARA + findings.PARA
            + "11 measured run(s) included a compile: left out.")
    assert findings.item_html(item) == (
        "<p><b>Root cause</b>: a &lt;stale&gt; schedule.</p>"
        "<p><b>Who wrote it</b> (probe-builds-tp1, s38): the capture.</p>"
        "<p><b>Does the crash need that NaN?</b> (five matrices) yes.</p>"
        "<p>DFlash FULL (fixed) / no speculation, acceptance 6: 2.30x.</p>"     # the parenthesis is no topic's
        "<p>11 measured run(s) included a compile: left out.</p>")              # nor is a word run into one
    assert findings.topic_of("x" * 71 + ": too long for a topic") is None
    assert findings.topic_of("A topic (with (nested) parts): text") == "A topic"
    assert findings.topic_of("No topic (its parenthesis never closes: text") is None
    assert findings.topic_of("offline, TP=1, FULL_AND_PIECEWISE (core dump on): a kernel") is None   # a list entry


def test_sampled_and_greedy_rows_of_one_engine_merge_and_nothing_else_does():
    import pandas as pd

    from dflash_lab import findings

    def row(cfg, session="2026-12-05-s70", runs=3, crashed=0, ctrl=0, ctrl_crashed=0, cores="-", matrices="m"):
        return {"vLLM": "0.26.0", "GPU session": session, "configuration": cfg, "runs": runs, "crashed": crashed,
                "completed": runs - crashed, "diff": "", "0.22.1 controls (same session and configuration)": ctrl,
                "0.22.1 crashed": ctrl_crashed, "0.22.1 cores": cores, "matrices": matrices}

    base = "FULL_AND_PIECEWISE, offline, TP=1, concurrency 32, acceptance 1.86, 512 tokens, "
    c8 = base.replace("32", "8")
    t = pd.DataFrame([row(base + "temperature 0.7", ctrl=2, ctrl_crashed=2, cores="k_a"),
                      row(base + "greedy", runs=2, ctrl=1, ctrl_crashed=1, cores="k_a, k_b"),
                      row(base + "greedy", session="2026-12-05-s71", runs=2),           # another session
                      row(c8 + "greedy", runs=2),                                       # another concurrency
                      row(c8 + "temperature 0.7", ctrl=3),                              # with controls, the other without
                      row(c8 + "temperature 0.7", session="2026-12-05-s72", crashed=1),  # a crash: which kind, said
                      row(c8 + "greedy", session="2026-12-05-s72", runs=2),
                      row(c8 + "temperature 0.7", session="2026-12-05-s73", matrices="a"),  # other matrices: maybe
                      row(c8 + "greedy", session="2026-12-05-s73", runs=2, matrices="b")])  # other engines
    m = findings._merged_sampling(t)
    assert m[0]["configuration"] == base + "3 at temperature 0.7 and 2 greedy"
    assert (m[0]["runs"], m[0]["crashed"], m[0]["completed"]) == (5, 0, 5)
    assert (m[0]["0.22.1 controls (same session and configuration)"], m[0]["0.22.1 crashed"]) == (3, 3)
    assert m[0]["0.22.1 cores"] == "k_a, k_b"
    assert [x["configuration"] for x in m[1:]] == [base + "greedy", c8 + "greedy", c8 + "temperature 0.7",
                                                   c8 + "temperature 0.7", c8 + "greedy",
                                                   c8 + "temperature 0.7", c8 + "greedy"]


def test_the_root_cause_sentence_says_what_the_published_drafts_gpu_runs_measured(root):
    import copy

    from dflash_lab import analysis, findings

    lines = [r for _, _, r in analysis.recorded_lines(str(root / "data" / "runs" / "*.jsonl"))
             if r.get("matrix") == "draft8-c32-tp1"]
    assert findings.draft8_gpu_clause(lines) == (
        "on the GPU, in sessions s70 and s71, its stock engine crashed 4 of 4 runs at 32 (1 of 1 in s70, 3 of 3 in s71), "
        "the core naming copy_and_expand_dflash_inputs_kernel; the fix completed 3 of 3 runs in s71, beside that "
        "session's stock crashes (sampled: its tokens not compared with a reference path); PIECEWISE completed 2 of 2 "
        "runs; notebook 03")
    s70 = [r for r in lines if r["gpu_session"] == "2026-12-06-s70"]
    assert findings.draft8_gpu_clause(s70) == (
        "on the GPU, in session s70, its stock engine crashed 1 of 1 run at 32, the core naming "
        "copy_and_expand_dflash_inputs_kernel; the fix and PIECEWISE have not run with it; notebook 03")
    fix = dict(copy.deepcopy(s70[0]), engine_id="d8-fix-c32", outcome="ok", requests_completed=32, fault=None)
    short = dict(copy.deepcopy(fix), requests_completed=30)
    cut = dict(copy.deepcopy(s70[0]), outcome="startup_error")
    assert findings.draft8_gpu_clause(s70 + [fix, short, cut]) == (
        "on the GPU, in session s70, its stock engine crashed 1 of 1 run at 32, the core naming "
        "copy_and_expand_dflash_inputs_kernel; the fix completed 1 of 2 runs in s70, beside that session's stock "
        "crashes (sampled: its tokens not compared with a reference path); PIECEWISE has not run with it; notebook 03")
    # the fix in a session whose stock did not crash, greedy: said so, and no sampling caveat
    alone = dict(copy.deepcopy(fix), gpu_session="2026-12-07-s72", temperature=0.0)
    assert findings.draft8_gpu_clause(s70 + [alone]) == (
        "on the GPU, in sessions s70 and s72, its stock engine crashed 1 of 1 run at 32, the core naming "
        "copy_and_expand_dflash_inputs_kernel; the fix completed 1 of 1 run in s72, where stock did not crash; "
        "PIECEWISE has not run with it; notebook 03")
    # the fix in two sessions: counted per session, each with its own stock control's outcome
    assert findings.draft8_gpu_clause(s70 + [fix, short, alone]) == (
        "on the GPU, in sessions s70 and s72, its stock engine crashed 1 of 1 run at 32, the core naming "
        "copy_and_expand_dflash_inputs_kernel; the fix completed 1 of 2 runs in s70, beside that session's stock "
        "crashes and 1 of 1 run in s72, where stock did not crash; PIECEWISE has not run with it; notebook 03")
    # the fix-claim standard's matrix: not run, then judged (verification.draft8_fix_predictions's rows)
    import pandas as pd
    assert findings.draft8_gpu_clause(s70, pd.DataFrame(columns=["prediction"])).endswith(
        "; the fix-claim standard with it (draft8-fix-c32-tp1: 10 runs, outputs compared) has not run; notebook 03")
    judged = pd.DataFrame([
        {"prediction": "(d) the greedy pair's token-identical requests", "measured": "32/32", "gpu_session": "x-s72",
         "held": True},
        {"prediction": "(d) the greedy pair's token-identical requests", "measured": "31/32", "gpu_session": "x-s72",
         "held": True},
        {"prediction": "(standard) fixed runs in a session whose stock control crashed",
         "measured": "13 completed, 0 not completed", "gpu_session": "2026-12-07-s72", "held": True}])
    assert findings.draft8_gpu_clause(s70, judged).endswith(
        "; the fix-claim standard with it (draft8-fix-c32-tp1, session s72): fixed runs beside a crashed stock control "
        "13 completed, 0 not completed (the count met), greedy pairs with PIECEWISE 32/32, 31/32 requests "
        "token-identical, as predicted (>= 30 of 32); notebook 03")
    # a pair short of the prediction: the output part is not met, whatever the count says
    short_pair = judged.assign(measured=["32/32", "21/32", "13 completed, 0 not completed"], held=[True, False, True])
    assert findings.draft8_gpu_clause(s70, short_pair).endswith(
        "(the count met), greedy pairs with PIECEWISE 32/32, 21/32 requests token-identical, short of the predicted "
        "30 of 32, so the output part is not met as pre-registered; notebook 03")
    # where the failed pairs' runs came after their engines' starts, when the two sides differ (different draws)
    places = pd.DataFrame({"runs before it on its engine (FULL, reference)": ["10, 0", "11, 1", "12, 2"]})
    assert findings.draft8_gpu_clause(s70, short_pair, places).endswith(
        "not met as pre-registered (its paired runs came 10-12 runs after the fixed engine's start and 0-2 after "
        "PIECEWISE's, so they compared different synthetic-acceptance draws); notebook 03")
    same = pd.DataFrame({"runs before it on its engine (FULL, reference)": ["0, 0", "1, 1"]})
    assert findings.draft8_gpu_clause(s70, short_pair, same) == findings.draft8_gpu_clause(s70, short_pair)
    # a pair not judged (None): undecided, never "as predicted"; pairs short of those planned are said
    undecided = judged.assign(held=[True, None, True])
    assert "not all judged, so the output part is undecided; notebook 03" in findings.draft8_gpu_clause(s70, undecided)
    planned = pd.DataFrame([{"prediction": "(d) greedy pairs measured of those planned", "measured": "2",
                             "gpu_session": "x-s72", "held": False}])
    assert findings.draft8_gpu_clause(s70, pd.concat([judged, planned], ignore_index=True)).endswith(
        "as predicted (>= 30 of 32), but only 2 of the planned pairs measured; notebook 03")
    # no pair compared (a greedy engine cut): the count alone is not the standard
    no_pair = judged[judged["prediction"].str.startswith("(standard)")].assign(
        measured="9 completed, 0 not completed", held=False)
    assert findings.draft8_gpu_clause(s70, no_pair).endswith(
        "fixed runs beside a crashed stock control 9 completed, 0 not completed (the count not met), no greedy pair "
        "compared, so the output part is not met; notebook 03")
    assert findings.draft8_gpu_clause([]) == ""
    assert findings.draft8_gpu_clause([cut]) == "its GPU runs measured nothing yet; notebook 03"


def test_the_later_release_item_says_what_the_records_give_for_the_published_draft(root):
    import json

    from dflash_lab import findings, upstream

    rows = sorted(upstream.load(root / "data" / "upstream" / "releases.jsonl"),
                  key=lambda r: upstream.version_key(r["version"]))
    text = findings._published_draft_clause(rows)
    assert ("With the published draft's 8 layers the grouping of every release read (0.23.0-0.34.0) still puts the "
            "target's attention layers 7, 15, 23, 31, 39 in a group that reuses another's metadata.") in text
    assert "only 0.23.0 and 0.24.0 of these build such a draft as full attention (as 0.22.1 does)" in text
    assert text in findings.upstream_clause(root)
    # computed from the records: another release's verdict changes the sentence; records without the fields say nothing
    alt = json.loads(json.dumps(rows))
    alt[2][upstream.DRAFT_WINDOWS]["mixed sliding and full layers"] = upstream.WIN_IGNORED
    alt[5]["grouping"][upstream.PUBLISHED_GROUPING]["reusing attention groups"] = []
    t = findings._published_draft_clause(alt)
    assert "only 0.23.0-0.25.0 of these build" in t and "grouping of 0.23.0-0.26.0, 0.27.1-0.34.0 still puts" in t
    assert "reuses another's metadata (not so in 0.27.0)." in t
    for r in alt:
        r["grouping"][upstream.PUBLISHED_GROUPING]["reusing attention groups"] = []
    assert ("With the published draft's 8 layers no release's grouping puts the target's attention layers 7, 15, 23, 31, "
            "39 in a group") in findings._published_draft_clause(alt)
    assert findings._ranges(["0.25.0"], [r["version"] for r in rows]) == "0.25.0"
    for r in alt:
        r.pop(upstream.DRAFT_WINDOWS)
        r["grouping"].pop(upstream.PUBLISHED_GROUPING)
    assert findings._published_draft_clause(alt) == ""


def test_the_root_cause_item_says_what_later_releases_code_shows(root, tmp_path):
    from dflash_lab import findings

    text = findings.upstream_clause(root)
    assert text.startswith(findings.PARA + "Later vLLM releases (their own sources, read on the CPU")
    assert ("in 0.23.0, 0.24.0, 0.25.0, 0.25.1, 0.26.0, 0.27.0, 0.27.1, 0.28.0 the precondition is in the V1 model runner, "
            "the one this engine gets by default by the release's own rule") in text
    assert ("in 0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0 it is still in the V1 runner, but by the release's rule this "
            "engine gets the V2 runner by default") in text and "needs VLLM_USE_V2_MODEL_RUNNER=0" in text
    assert ("in 0.34.0 it is absent (no V1 runner; its V2 runner reuses metadata only for Mamba groups, at capture as "
            "at run time; the DFlash input kernel is gone too)") in text
    assert "not decided" not in text and "has not been run" not in text
    assert (findings.PARA + "On the GPU (notebook 04): 0.26.0 completed 6 of 6 runs (FULL_AND_PIECEWISE, offline, TP=1, "
            "concurrency 32, acceptance 1.86, 512 tokens, temperature 0.7; session s65), where the same engine on 0.22.1 "
            "crashed 1 of 1 in that session (core: copy_and_expand_dflash_inputs_kernel);") in text
    assert "vLLM PR #44744" in text and "wrong values need no longer end in a crash" in text
    # s67: what the greedy tokens measured, beside the 0.22.1 control of the session (controls that did not crash are
    # said as such, not as "crashed 0 of 3")
    # one engine's sampled and greedy runs of a session are one entry (the list had seven for four engines)
    assert ("0.26.0 completed 5 of 5 runs (FULL_AND_PIECEWISE, offline, TP=1, concurrency 8, acceptance 6.0, 512 tokens, "
            "3 at temperature 0.7 and 2 greedy; session s67), and the same engine on 0.22.1 crashed in none of 5 in that "
            "session") in text
    assert ("512 tokens, 3 at temperature 0.7 and 2 greedy, with vllm-0.26.0-part1.diff; session s68) (an engine with a "
            "diff: no stock 0.22.1 engine is its control)") in text
    assert ("in each of 0.26.0's 2 FULL_AND_PIECEWISE runs, 7 of 8 requests left the outputs that the reference-path "
            "runs of this prompt give (5 stock PIECEWISE runs on vLLM 0.22.1). Every wrong token was a step's last one, "
            "the target's own sample. None had a non-finite log-probability, and vLLM counted 6.000 tokens per step.") in text
    assert "so a small numerical difference can flip a greedy choice; the reference outputs differ only within their " \
           "first 3 tokens." in text
    # s68: 0.26.0's own PIECEWISE engine, and the fix's part 1 ported to 0.26.0, each in session s68; the stock FULL
    # runs' session is s67's, not the first 0.26.0 line's
    assert "Measured in session s67 (concurrency 8" in text and "Measured in session s68" not in text
    assert ("0.26.0's own PIECEWISE engine (session s68) gave the reference output in 16 of 16 requests of its 2 greedy "
            "runs, its requests' log-probabilities within 0.002 of request 0's (stock FULL's in session s67, along the "
            "tokens its requests share with request 0 before they part: up to 0.34).") in text
    assert ("the same FULL_AND_PIECEWISE engine (session s68) gave the reference output in 16 of 16 requests of its 2 "
            "greedy runs (all four predictions written before its runs held); against 0.26.0 PIECEWISE of the same "
            "session, round by round, 16 of 16 requests had identical tokens") in text
    assert "has not run at that shape" not in text and "No run has tested" not in text
    # stock FULL's wrong tokens are s67's, part 1's runs s68's: consistent, not concluded (no same-session control)
    assert text.endswith("That is what the stale schedule as the cause predicts, but stock FULL's wrong tokens were "
                         "measured in session s67, on another host: it is decided when stock FULL and part 1 run in one "
                         "session. Releases after 0.26.0 pin torch 2.13 or 2.14, which the GPU host lacks.")
    assert "is what makes" not in text and "is what made" not in text
    assert "crashed 0 of" not in text
    assert findings.upstream_clause(tmp_path) == ""     # nothing recorded: nothing said
    # sources recorded, no GPU run of a release: says so
    (tmp_path / "data" / "upstream").mkdir(parents=True)
    (tmp_path / "data" / "upstream" / "releases.jsonl").write_text((root / "data/upstream/releases.jsonl").read_text())
    assert findings.upstream_clause(tmp_path).endswith(" Whether any of them crashes has not been run (notebook 04).")
