"""Muon's pieces (zero/optim/muon.py): the whole-matrix update equal to torch.optim.Muon, DeepSpeed's split
of parameters and routing of config keys, and the balanced assignment of matrices to owner ranks."""
import pytest
import torch
import torch.nn as nn

from zero.optim.muon import MuonConfigError, assign_owners, muon_defaults, ns_cost, route, split, update_matrix


@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (6, 6)])
def test_one_matrix_updates_exactly_as_torch_optim_muon(shape):
    torch.manual_seed(0)
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True, "ns_steps": 5,
                "adjust_lr_fn": "match_rms_adamw"}
    theirs = nn.Parameter(torch.randn(shape))
    mine, buffer = theirs.detach().clone(), torch.zeros(shape)
    reference = torch.optim.Muon([theirs], **settings)
    for step in range(5):
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        theirs.grad = grad.clone()
        reference.step()
        update_matrix(mine, grad, buffer, **settings)
        assert torch.equal(mine, theirs.detach()), step
    assert torch.equal(buffer, reference.state[theirs]["momentum_buffer"])
    assert muon_defaults()["ns_steps"] == 5 and muon_defaults()["nesterov"] is True
    with pytest.raises(ValueError, match="2-D parameter"):
        update_matrix(torch.zeros(4), torch.zeros(4), torch.zeros(4))


def test_the_offload_path_takes_torchs_steps_with_newton_schulz_elsewhere():
    """[Note: Newton-Schulz under offload]: the host keeps master and momentum, another device runs
    Newton-Schulz; with that device the host itself the numbers are torch's, bit for bit."""
    from zero.optim.muon import _update_across

    settings = {**muon_defaults(), "lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    for nesterov in (True, False):
        theirs = nn.Parameter(torch.randn(9, 4, generator=torch.Generator().manual_seed(1)))
        mine, buffer = theirs.detach().clone(), torch.zeros(9, 4)
        reference = torch.optim.Muon([theirs], **{**settings, "nesterov": nesterov})
        for step in range(3):
            grad = torch.randn(9, 4, generator=torch.Generator().manual_seed(step))
            theirs.grad = grad.clone()
            reference.step()
            _update_across(mine, grad, buffer, torch.device("cpu"), {**settings, "nesterov": nesterov})
            assert torch.equal(mine, theirs.detach()), (nesterov, step)


def test_deepspeeds_split_and_the_use_muon_override():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 4)
            self.frozen = nn.Linear(4, 4)
            self.lm_head = nn.Linear(4, 10, bias=False)
            self.conv = nn.Conv2d(1, 2, 3)

    net = Net()
    net.frozen.weight.requires_grad_(False)
    net.conv.weight.use_muon = False  # the user keeps this one with AdamW
    muon, adamw = split(net.named_parameters())
    assert muon == ["fc.weight"]
    assert adamw == ["embed_tokens.weight", "fc.bias", "frozen.bias", "lm_head.weight", "conv.weight", "conv.bias"]
    net.fc.bias.use_muon = True
    with pytest.raises(MuonConfigError, match=r"'fc.bias' has use_muon=True but shape \(4,\)"):
        split(net.named_parameters())
    shard = nn.Parameter(torch.zeros(3))  # a stage-3 shard of a 2-D layer: its layer shape decides
    shard.ds_shape = torch.Size([4, 4])
    assert split([("layer.weight", shard)]) == (["layer.weight"], [])


def test_the_config_keys_reach_the_half_deepspeed_routes_them_to():
    got = route({"lr": 1e-3, "muon_lr": 0.02, "momentum": 0.9, "ns_steps": 6, "betas": [0.9, 0.95], "eps": 1e-8,
                 "weight_decay": 0.01, "ns_method": "standard"})
    assert got.muon == {"lr": 0.02, "momentum": 0.9, "ns_steps": 6, "weight_decay": 0.01}
    assert got.adamw == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    assert route({"adam_lr": 3e-4}).adamw == {"lr": 3e-4} and route({}).muon == {}
    for bad, says in (({"ns_method": "gram"}, "'gram' variant is not implemented"),
                      ({"ns_method": "svd"}, "ns_method: 'svd'"), ({"adjust_lr_fn": "rms"}, "adjust_lr_fn"),
                      ({"ns_coefficients": [1, 2]}, "three numbers"), ({"amsgrad": True}, r"\['amsgrad'\]")):
        with pytest.raises(MuonConfigError, match=says):
            route(bad)


def test_matrices_are_assigned_whole_and_balanced_by_their_newton_schulz_work():
    shapes = [(4096, 1024), (1024, 4096), (1024, 1024), (1024, 1024), (512, 512), (256, 1024), (3, 7)]
    for world in (1, 2, 3, 4):
        owners = assign_owners(shapes, world)
        assert owners == assign_owners(shapes, world) and set(owners) <= set(range(world))
        load = [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(world)]
        assert max(load) - min(load) <= max(ns_cost(s) for s in shapes), (world, load)
    assert ns_cost((4096, 1024)) == ns_cost((1024, 4096)) == 1024 * 1024 * 4096
