import torch
from helpers.sp import LossSpec, build_model, joint_step
from helpers.tree import DEPTH2, DEPTH3, tree_group
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.planner import GroupPlan, ModelShape, tree_memory
from scalerlt_mcore.shared_prefix.tree_schedule import nodes_with_loss
BUSHY = [(None, 24), (0, 6), (1, 3), (1, 3), (1, 2), (0, 6), (5, 3), (5, 3), (0, 5), (8, 4),
         (9, 2), (9, 3), (0, 3)]
MODELS = {"f32": lambda: build_model(R=2),
          "bf16": lambda: build_model(R=2).to(torch.bfloat16),
          "bf16-concat": lambda: build_model(R=2, attn="concat").to(torch.bfloat16),
          "trunc": lambda: build_model(R=3, arch=True, looped_backprop_loops=1).double()}
def test_m(mcore_single):
  for mname, mk in MODELS.items():
    model = mk(); m = ModelShape.from_model(model)
    dt = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    for name, shape in (("d2", DEPTH2), ("d3", DEPTH3), ("bushy", BUSHY)):
        group = tree_group(shape, model.config.looped_num_loops, seed=1, dtype=dt)
        N = group.tree.num_nodes; hl = nodes_with_loss(group)
        spec = LossSpec(); lpp = spec.objective().saved_per_position
        for ck in (False, True):
          for mode in ("none", "all"):
            plan = GroupPlan(2, retain_nodes=tuple(mode == "all" for n in range(N)))
            model.zero_grad(set_to_none=True)
            with SavedTensorProbe(model) as probe:
                joint_step(model, [group], spec, 2, chooser=lambda g, mod, num_loops=None, p=plan: p, checkpoint_waves=ck)
            pred = tree_memory(m, group.tree, plan, hl, lpp).saved_bytes
            got = probe.peak_bytes
            print(mname, name, ck, mode, pred, got, f"{pred/got-1:+.3f}")
