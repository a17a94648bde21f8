"""EngineControl labels every generation phase with the current policy version, also when something else (an
evaluation's rollout phase) stopped the engine between the pipeline's phases.

The fake mirrors MegatronInference: pause/resume do nothing while the engine is stopped (resume then does not
set the version either), and a generation restarts a stopped engine with whatever version it last had."""
import contextlib

from megatron.rl.inference.control import TrainerControl
from megatron.rl.rollout.async_source import EngineControl


class _Engine(TrainerControl):
    def __init__(self):
        self.version = None
        self.active = False
        self.entered = 0
        self.pauses = []  # per pause_generation call: whether the engine was running (else it is a no-op)

    @contextlib.contextmanager
    def rollout_phase(self):
        self.entered += 1
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def set_policy_version(self, version):
        self.version = version

    def pause_generation(self):
        self.pauses.append(self.active)

    def resume_generation(self, version):
        if self.active:
            self.version = version


def test_each_phase_start_sets_the_version_after_an_evaluation_stopped_the_engine():
    engine = _Engine()
    control = EngineControl(engine)
    control.start(0)
    assert engine.version == 0
    control.stop(drained=False)  # requests in flight at the update: paused
    engine.active = False  # an evaluation's rollout phase finished them and stopped the engine
    control.resume(1)  # weights_updated(1): the engine is stopped, so its version is not touched
    control.start(1)  # next generation phase (the engine restarts on the first request)
    assert engine.version == 1  # not 0: the tokens of policy 1 are not recorded as policy 0's
    control.close()


def test_a_phase_start_restarts_an_engine_an_evaluation_stopped_so_every_rank_pauses_at_its_end():
    """Two ranks of one lockstep engine: the pipeline's phase on rank 0 submits a request (which would restart a
    stopped engine lazily), on rank 1 it ends on groups already finished. Were rank 1's engine left stopped, its
    pause_generation would return at once and it would go on while rank 0 waits for it to pause (a deadlock of a
    TP=2 inference copy). Both engines run at the phase end and both pause."""
    ranks = [_Engine(), _Engine()]
    controls = [EngineControl(e) for e in ranks]
    for c in controls:
        c.start(0)
        c.stop(drained=False)
        c.resume(1)
    for e in ranks:
        e.active = False  # the evaluation after update 1 exited inference mode on both ranks (collective)
    for rank, (c, e) in enumerate(zip(controls, ranks)):
        c.start(1)
        if rank == 0 and not e.active:  # agenerate restarts a stopped engine on the first request
            e.active = True
        c.stop(drained=False)
    assert [e.pauses for e in ranks] == [[True, True], [True, True]]  # was [True, False] on rank 1
    assert [e.entered for e in ranks] == [2, 2]
    for c in controls:
        c.close()
