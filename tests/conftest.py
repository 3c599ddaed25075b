"""Settings of the test process itself.

Many tests run several in-process learners (threads) beside a syncer on a 2-core machine;
one torch thread per process keeps them from oversubscribing the cores (the Learner leaves
the thread count to its user, see ``LearnerConfig.cpu_threads``)."""

import torch

torch.set_num_threads(1)
