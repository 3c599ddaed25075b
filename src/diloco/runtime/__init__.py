"""Process plumbing shared by the syncer, learners and launchers: child processes and the
parent watch (:mod:`~diloco.runtime.procs`), warm spares (:mod:`~diloco.runtime.spare`), the
background checkpoint writer and the checkpoint cadence."""
