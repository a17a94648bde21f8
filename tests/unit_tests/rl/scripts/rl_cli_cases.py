"""Run train_rl.main(argv) for several bad-input cases in one process (imports paid once); JSON results.

    python rl_cli_cases.py CASES.json OUT.json

CASES.json: ``{name: argv}``. OUT.json: ``{name: {"ok": bool, "error_type": str, "error": str}}``.
train_rl.main is what ``python train_rl.py`` runs (parse flags, validate, run, destroy_megatron); bad input
it reports itself (one line "train_rl.py: error: ErrorType: message", exit status 2) counts as not ok with
that error.
"""
import json
import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))
sys.path.insert(0, REPO)


def main() -> int:
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_rl_cli", os.path.join(REPO, "train_rl.py"))
    train_rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_rl)
    cases = json.loads(open(sys.argv[1]).read())
    from megatron.rl.training import cli_errors

    reported: list[str] = []
    report = cli_errors.report_user_error

    def capture(program, error, stream=None):
        reported.append(f"{type(error).__name__}: {error}")
        return report(program, error, stream)

    cli_errors.report_user_error = capture
    out = {}
    for name, argv in cases.items():
        reported.clear()
        try:
            rc = train_rl.main(argv)
            if rc == 2 and reported:
                error_type, _, error = reported[-1].partition(": ")
                out[name] = {"ok": False, "rc": rc, "error_type": error_type, "error": error}
            else:
                out[name] = {"ok": True, "rc": rc}
        except BaseException as e:  # SystemExit from argparse too
            out[name] = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
        print(f"case {name}: {out[name]}", flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
