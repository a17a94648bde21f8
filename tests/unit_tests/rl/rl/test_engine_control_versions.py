"""EngineControl labels every generation phase with the current policy version, also when something else (an
evaluation's rollout phase) stopped the engine between the pipeline's phases.

The fake mirrors MegatronInference: pause/resume do nothing while the engine is stopped (resume then does not
set the version either), and a generation restarts a stopped engine with whatever version it last had."""
import contextlib

from megatron.rl.async_rollouts import EngineControl


class _Engine:
    def __init__(self):
        self.version = None
        self.active = False

    @contextlib.contextmanager
    def rollout_phase(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def set_policy_version(self, version):
        self.version = version

    def pause_generation(self):
        pass

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
    assert engine.version == 1  # was 0: the tokens of policy 1 were recorded as policy 0's (staleness 2, lag 1)
    control.close()
