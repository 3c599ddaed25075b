"""The README's example, verbatim in spirit: an ordinary loop plus the Learner lines."""

import torch

import diloco
from diloco.syncer.config import SyncerConfig
from diloco.wire.protocol import ProtocolConfig


def test_readme_loop_with_for_model_syncer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with diloco.SyncerServer.for_model(
        model, config=SyncerConfig(protocol=ProtocolConfig(num_fragments=4))
    ) as server:
        server.start()
        learner = diloco.Learner(
            model, optimizer, syncer=server.address, num_fragments=4, learner_id="a"
        )
        with learner:
            assert learner.wait_for_global(timeout=30)
            for _ in range(40):
                x = torch.randn(16, 8)
                loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                learner.step(tokens=x.shape[0])
        assert server.state.rounds_committed >= 4
        assert min(server.state.versions) >= 1


def test_the_learner_leaves_the_processs_thread_count_alone_unless_asked():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with diloco.SyncerServer.for_model(
            model, config=SyncerConfig(protocol=ProtocolConfig(num_fragments=2))
        ) as server:
            with diloco.Learner(
                model, optimizer, syncer=server.address, num_fragments=2
            ) as learner:
                assert learner.wait_for_global(timeout=30)
                assert torch.get_num_threads() == 2  # the default: not touched
            with diloco.Learner(
                model, optimizer, syncer=server.address, num_fragments=2, cpu_threads=1
            ):
                assert torch.get_num_threads() == 1  # asked for
    finally:
        torch.set_num_threads(before)
