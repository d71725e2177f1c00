"""The checks of lab 08 (minifsdp.labcheck.lab08) judge the learner's code: the solution passes, the
blank lab and typical mistakes (the solution with one small edit) fail with one sentence."""
from __future__ import annotations

from labcheck_helpers import fails, lab_tests, load
from minifsdp import tensor_parallel as tpl
from minifsdp.labcheck import lab08

L08 = "08_tensor_parallel"

F_BACKWARD_LOCAL = (("        grad = grad.clone()\n        comm.all_reduce(grad, group=get_model_parallel_group())\n"
                     "        return grad", "        return grad"),)
G_BACKWARD_REDUCES = (("        # HINT: the output's gradient is already identical on every rank\n        return grad",
                       "        grad = grad.clone()\n        comm.all_reduce(grad, group=get_model_parallel_group())\n"
                       "        return grad"),)
G_IN_PLACE = (("        out = x.clone()\n        comm.all_reduce(out, group=get_model_parallel_group())\n        return out",
               "        comm.all_reduce(x, group=get_model_parallel_group())\n        return x"),)
BIAS_BEFORE_G = (("return ReduceFromTP.apply(F.linear(h, self.c_proj.weight)) + self.c_proj.bias",
                  "return ReduceFromTP.apply(self.c_proj(h))"),)
NO_F = (("h = F.gelu(self.c_fc(CopyToTP.apply(x)))", "h = F.gelu(self.c_fc(x))"),)
CONTIGUOUS_QKV = (("q, k, v = weight.chunk(3)\n    return torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])",
                   "return weight.chunk(tp)[r]"),)
QKV_WRONG_ORDER = (("return torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])",
                    "return torch.cat([q.chunk(tp)[r], v.chunk(tp)[r], k.chunk(tp)[r]])"),)
NO_MASK = (("probs = F.softmax(scores.masked_fill(self.future_mask[:T, :T], float(\"-inf\")), dim=-1)",
            "probs = F.softmax(scores, dim=-1)"),)
ATTN_BIAS_BEFORE_G = (("return ReduceFromTP.apply(F.linear(y, self.c_proj.weight)) + self.c_proj.bias",
                       "return ReduceFromTP.apply(self.c_proj(y))"),)
GATHER_BATCH = (("gathered = comm.all_gather(x.transpose(0, 1).contiguous(), group=get_model_parallel_group())\n"
                 "        return gathered.transpose(0, 1).contiguous()",
                 "return comm.all_gather(x.contiguous(), group=get_model_parallel_group())"),)
GATHER_BACKWARD_SLICES = (("summed = comm.reduce_scatter(grad.transpose(0, 1).contiguous(), group=get_model_parallel_group())\n"
                           "        return summed.transpose(0, 1).contiguous()",
                           "r, tp = get_model_parallel_rank(), get_model_parallel_world_size()\n"
                           "        return grad.chunk(tp, dim=1)[r].contiguous()"),)
OWN_MAX = (("    comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group)\n", ""),)
UNMASKED_TARGET = (("target_logit = torch.where(mine, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)",
                    "target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)"),)


CHECKS = [(lab08.f_and_g, ("CopyToTP", "ReduceFromTP")), (lab08.parallel_mlp, ("ParallelMLP",)),
          (lab08.qkv_shard, ("shard_qkv",)), (lab08.parallel_attention, ("ParallelAttention",)),
          (lab08.vocab_parallel_loss, ("vocab_parallel_loss",)),
          (lab08.sequence_parallel_ops, ("GatherSequence", "ReduceScatterSequence"))]
MISTAKES = (NO_MASK, ATTN_BIAS_BEFORE_G, GATHER_BATCH, GATHER_BACKWARD_SLICES, F_BACKWARD_LOCAL,
            G_BACKWARD_REDUCES, G_IN_PLACE, BIAS_BEFORE_G, NO_F, CONTIGUOUS_QKV, QKV_WRONG_ORDER, OWN_MAX,
            UNMASKED_TARGET)
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(L08, CHECKS, MISTAKES, words=("yours", "target"))


def test_f_and_g_mistakes():
    ns = load(L08, edits=F_BACKWARD_LOCAL)
    fails(lab08.f_and_g, ns["CopyToTP"], ns["ReduceFromTP"], words="this rank's gradient only")
    ns = load(L08, edits=G_BACKWARD_REDUCES)
    fails(lab08.f_and_g, ns["CopyToTP"], ns["ReduceFromTP"], words="2x too big")
    ns = load(L08, edits=G_IN_PLACE)
    fails(lab08.f_and_g, ns["CopyToTP"], ns["ReduceFromTP"], words="in place")


def test_mlp_mistakes_and_library():
    fails(lab08.parallel_mlp, load(L08, edits=BIAS_BEFORE_G)["ParallelMLP"], words="bias 2x over")
    fails(lab08.parallel_mlp, load(L08, edits=NO_F)["ParallelMLP"], words="must enter through f")
    fails(lab08.f_and_g, tpl.mappings._CopyToModelParallelRegion, tpl.mappings._ReduceFromModelParallelRegion,
          words="library")


def test_qkv_and_loss_mistakes():
    fails(lab08.qkv_shard, load(L08, edits=CONTIGUOUS_QKV)["shard_qkv"], words="contiguous block")
    fails(lab08.qkv_shard, load(L08, edits=QKV_WRONG_ORDER)["shard_qkv"], words="in that order")
    fails(lab08.vocab_parallel_loss, load(L08, edits=OWN_MAX)["vocab_parallel_loss"], words="global max")
    fails(lab08.vocab_parallel_loss, load(L08, edits=UNMASKED_TARGET)["vocab_parallel_loss"],
          words="owns the target id")


def test_attention_and_sequence_parallel_mistakes():
    fails(lab08.parallel_attention, load(L08, edits=NO_MASK)["ParallelAttention"], words="differs from the full")
    fails(lab08.parallel_attention, load(L08, edits=ATTN_BIAS_BEFORE_G)["ParallelAttention"], words="bias 2x over")
    ns = load(L08, edits=GATHER_BATCH)
    fails(lab08.sequence_parallel_ops, ns["GatherSequence"], ns["ReduceScatterSequence"], words="dim 1")
    ns = load(L08, edits=GATHER_BACKWARD_SLICES)
    fails(lab08.sequence_parallel_ops, ns["GatherSequence"], ns["ReduceScatterSequence"], words="reduce-scatter")
