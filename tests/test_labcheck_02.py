"""The checks of lab 02 (minifsdp.labcheck.lab02) judge the learner's code.

Each check must pass with the solution, and fail with a clear sentence
(``CheckFailed``) on the blank lab, on typical mistakes and on library
shortcuts - written the way a learner looking for one would: a notebook helper
behind an alias, an import under another name, a subclass calling
``super().__init__``, the library reached through ``importlib`` (which only the
run-time wire sees), the library DDP's private sync methods called by hand.
See labcheck_helpers.py for how the notebook's cells are loaded.
"""
from __future__ import annotations


import pytest

from labcheck_helpers import edits_apply, fails, load, run_cell, shortcut_fails  # noqa: F401

L02 = "02_data_parallel"
EXTRA02: tuple[str, ...] = ()


@pytest.fixture(scope="module")
def lab02():
    from minifsdp.labcheck import lab02
    return lab02


def with_code(code: str) -> dict:
    """The solution's namespace (a ``__main__`` module, so launch sends its functions by value), with
    ``code`` run in it: a learner's replacement of an exercise."""
    return run_cell(load(L02, extra=EXTRA02), code)


def test_lab02_solution_passes(lab02, capsys):
    ns = load(L02, extra=EXTRA02)
    lab02.hook_ddp(ns["make_data_parallel"])
    lab02.bucket_layout(ns["bucket_layout"])
    fig = lab02.bucketed_ddp(ns["BucketedDDP"])
    assert fig.get_size_inches()[0] <= 11
    lab02.accumulation(ns["accumulation_step"], 4, 16)
    out = capsys.readouterr().out
    assert out.count("✅ passed") == 4 and "2·4Ψ" in out and "library" in out, out
    assert "parameters" in out and "world sizes [2, 4]" in out, out


def test_lab02_blank_fails(lab02):
    ns = load(L02, blank=True, extra=EXTRA02,
              edits=(("layout = bucket_layout(list(mini.parameters()), int(cap * MiB))", "continue"),))
    fails(lab02.hook_ddp, ns["make_data_parallel"], words="not written yet")
    fails(lab02.bucket_layout, ns["bucket_layout"], words="not written yet")
    fails(lab02.bucketed_ddp, ns["BucketedDDP"], words="not written yet")
    fails(lab02.accumulation, ns["accumulation_step"], 4, 16, words="not written yet")


@pytest.mark.parametrize("check, name, edits, words", [
    ("hook_ddp", "make_data_parallel", (("        p.grad.div_(world)\n", "        pass\n"),), "too large"),
    ("hook_ddp", "make_data_parallel", (("            comm.broadcast(p, src=0)\n", "            pass\n"),),
     "different weights"),
    ("bucket_layout", "bucket_layout", (("for i in reversed(range(len(params))):", "for i in range(len(params)):"),),
     "reverse"),
    ("bucket_layout", "bucket_layout", (("    if current:\n        buckets.append(current)\n", ""),),
     "exactly one bucket"),
    ("bucketed_ddp", "BucketedDDP", (("            self.flat[k].div_(self.world)\n", ""),), "too large"),
    ("bucketed_ddp", "BucketedDDP",
     (("self.handles.append((k, comm.all_reduce(self.flat[k], async_op=True)))",
       "handle = comm.all_reduce(self.flat[k], async_op=True); handle.wait(); self.handles.append((k, handle))"),),
     "nothing overlapped"),
    ("bucketed_ddp", "BucketedDDP", (("        self.pending = [len(bucket) for bucket in self.buckets]\n        # END",
                                      "        # END"),), "step 1"),
    ("accumulation", "accumulation_step", (("    with model.no_sync():\n", "    if True:\n"),), "every micro-batch"),
    ("accumulation", "accumulation_step", (("(models.lm_loss(model(x), y) / k).backward()\n    # END",
                                            "models.lm_loss(model(x), y).backward()\n    # END"),), "divided by k"),
], ids=["hook-no-divide", "hook-no-broadcast", "layout-forward", "layout-drops-last", "bucketed-no-divide",
        "bucketed-blocking", "bucketed-no-reset", "accum-no-nosync", "accum-last-not-divided"])
def test_lab02_mistakes_fail(lab02, check, name, edits, words):
    edits_apply(L02, edits)
    ns = load(L02, extra=EXTRA02, edits=edits)
    fails(getattr(lab02, check), ns[name], words=words)


# ------------------------------------------------------------------ mistakes that are not in the solution's text
def test_accumulation_on_one_concatenated_batch_fails(lab02):
    ns = with_code('''
        def accumulation_step(model, micro_batches):
            x = torch.cat([x for x, _ in micro_batches])
            y = torch.cat([y for _, y in micro_batches])
            models.lm_loss(model(x), y).backward()      # right gradient, one all-reduce, k x the activations
    ''')
    fails(lab02.accumulation, ns["accumulation_step"], words="forward")


def test_accumulation_that_all_reduces_by_hand_fails(lab02):
    ns = with_code('''
        def accumulation_step(model, micro_batches):
            k = len(micro_batches)
            with model.no_sync():
                for x, y in micro_batches:
                    (models.lm_loss(model(x), y) / k).backward()
            for p in model.parameters():                # 2·4Ψ bytes, but not the model's buckets
                comm.all_reduce(p.grad)
                p.grad.div_(dist.world_size())
    ''')
    fails(lab02.accumulation, ns["accumulation_step"], words="bucket")


def test_a_ddp_without_all_reduce_fails_on_a_one_gpu_vm(lab02, monkeypatch):
    """On a 1-GPU VM the check still runs at least 2 ranks: on one rank a DDP that never all-reduces is 'right'."""
    monkeypatch.setenv("MINIFSDP_FAKE_GPU", "1")
    ns = with_code('''
        def make_data_parallel(model):
            with torch.no_grad():
                for p in model.parameters():
                    comm.broadcast(p, src=0)
            return model                                # no hooks: each rank keeps its own gradient
    ''')
    fails(lab02.hook_ddp, ns["make_data_parallel"], words="2 ranks")


# ------------------------------------------------------------------ library shortcuts, one or more per exercise
HOOK_SHORTCUTS = {
    "helper-behind-an-alias": '''
        from minifsdp.ddp import NaiveDataParallel as Averager

        def averaged(model):
            return Averager(model)

        def make_data_parallel(model):
            return averaged(model)
    ''',
    "importlib-only-the-wire-sees": '''
        import importlib

        def make_data_parallel(model):
            ddp = importlib.import_module("minifsdp." + "ddp")
            return getattr(ddp, "Naive" + "DataParallel")(model)
    ''',
    "torch-ddp": '''
        from torch.nn.parallel import DistributedDataParallel as Wrapper

        def make_data_parallel(model):
            return Wrapper(model)
    ''',
}


@pytest.mark.parametrize("code", HOOK_SHORTCUTS.values(), ids=HOOK_SHORTCUTS.keys())
def test_hook_ddp_refuses_the_library(lab02, code):
    shortcut_fails(lab02.hook_ddp, with_code(code)["make_data_parallel"])


LAYOUT_SHORTCUTS = {
    "import-under-another-name": '''
        from minifsdp.ddp import bucket_assignment as torch_rule

        def bucket_layout(params, cap_bytes):
            return torch_rule(params, cap_bytes / 2**20)
    ''',
    "importlib-only-the-wire-sees": '''
        import importlib

        def bucket_layout(params, cap_bytes):
            rule = getattr(importlib.import_module("minifsdp.ddp.bucketed"), "bucket_" + "assignment")
            return rule(params, cap_bytes / 2**20)
    ''',
    "torch-cxx-rule": '''
        import torch.distributed as tdist

        def bucket_layout(params, cap_bytes):
            order = list(reversed(range(len(params))))
            groups, _ = tdist._compute_bucket_assignment_by_size([params[i] for i in order], [cap_bytes])
            return [[order[j] for j in g] for g in groups]
    ''',
}


@pytest.mark.parametrize("code", LAYOUT_SHORTCUTS.values(), ids=LAYOUT_SHORTCUTS.keys())
def test_bucket_layout_refuses_the_library(lab02, code):
    shortcut_fails(lab02.bucket_layout, with_code(code)["bucket_layout"])


def test_the_library_itself_is_told_apart(lab02):
    from minifsdp.ddp import bucket_assignment
    fails(lab02.bucket_layout, bucket_assignment, words="library's own")


BUCKETED_SHORTCUTS = {
    "subclass-calling-super": '''
        from minifsdp.ddp import BucketedDataParallel

        class BucketedDDP(BucketedDataParallel):
            def __init__(self, model, bucket_cap_mb):
                super().__init__(model, bucket_cap_mb=bucket_cap_mb)
                self._armed = True                      # every backward syncs, through the library's hooks

            def grad_ready(self, i):
                pass

            def finish_gradient_sync(self):
                pass
    ''',
    "importlib-only-the-wire-sees": '''
        import importlib

        class BucketedDDP:
            def __init__(self, model, bucket_cap_mb):
                ddp = getattr(importlib.import_module("minifsdp.ddp"), "Distributed" + "DataParallel")
                self.inner = ddp(model, bucket_cap_mb=bucket_cap_mb)
                self.inner._armed = True

            def grad_ready(self, i):
                pass

            def finish_gradient_sync(self):
                pass
    ''',
}


@pytest.mark.parametrize("code", BUCKETED_SHORTCUTS.values(), ids=BUCKETED_SHORTCUTS.keys())
def test_bucketed_ddp_refuses_the_library(lab02, code):
    shortcut_fails(lab02.bucketed_ddp, with_code(code)["BucketedDDP"])


ACCUMULATION_SHORTCUTS = {
    # every micro-batch inside no_sync(), then the library DDP's own sync machinery called by hand
    "private-sync-methods-from-a-helper": '''
        def sync_now(model):
            for bucket in model.buckets:
                bucket.pending = 0
            model._launch_ready_buckets()
            for bucket in model.buckets:
                bucket.handle.wait()
            model._copy_back()
            model._reset_backward_state()

        def accumulation_step(model, micro_batches):
            k = len(micro_batches)
            with model.no_sync():
                for x, y in micro_batches:
                    (models.lm_loss(model(x), y) / k).backward()
            sync_now(model)
    ''',
    "another-library-ddp-behind-an-alias": '''
        from minifsdp.ddp import NaiveDataParallel as Syncer

        def accumulation_step(model, micro_batches):
            k = len(micro_batches)
            with model.no_sync():
                for x, y in micro_batches[:-1]:
                    (models.lm_loss(model(x), y) / k).backward()
                x, y = micro_batches[-1]
                (models.lm_loss(Syncer(model.module)(x), y) / k).backward()
    ''',
}


@pytest.mark.parametrize("code", ACCUMULATION_SHORTCUTS.values(), ids=ACCUMULATION_SHORTCUTS.keys())
def test_accumulation_refuses_the_library(lab02, code):
    shortcut_fails(lab02.accumulation, with_code(code)["accumulation_step"], 4, 16)


# ------------------------------------------------------------------ hints and what check.* offers
def test_hints_come_one_at_a_time_and_fit(lab02, capsys):
    for name in ("make_data_parallel", "bucket_layout", "BucketedDDP", "accumulation_step"):
        steps = len(lab02.hint.table[name])
        assert 2 <= steps <= 4
        for _ in range(steps + 1):
            lab02.hint(name)
        lab02.hint.again(name)
    out = capsys.readouterr().out
    assert all(len(line) <= 100 for line in out.splitlines()), out
    assert "hint 1 of" in out and "no more hints" in out


def test_the_checks_measuring_helpers_are_private(lab02):
    public = {n for n in vars(lab02) if not n.startswith("_")}
    assert not public & {"traced_steps", "step_report", "step_timeline"}, public
