"""The exit statuses of every `moe-fsm` command, in one place the commands and ``main`` import."""

EXIT_OK = 0
EXIT_DIFFERS = 1  # a check found a difference (replay, golden, diagram --check, diff), run's layers are off
# tolerance, or plan left a layer undecided
EXIT_BAD_INPUT = 2  # a flag, a file, an env value or a name is malformed (argparse's usage errors too)
EXIT_NO_BACKEND = 3  # the selection failed, or the selected kernel cannot be built here
EXIT_WRITE_FAILED = 4  # a trace, the run manifest or standard output could not be written
EXIT_INTERRUPTED = 130
EXIT_STATUSES = """exit status:
  0    success (a decision was made, a check found no difference)
  1    a check found a difference: replay, golden --check, diagram --check, diff (the decisions differ);
       run: a layer off tolerance; plan: a layer not mapped or not decided
  2    bad input: a flag, a file, an environment value or a name is malformed
  3    no backend: the selection failed (its trace is still written), or the kernel cannot be built here
  4    a trace, the run manifest or standard output could not be written
  130  interrupted (Ctrl-C); run --nproc: 124 past its timeout, 128+N on signal N, else a failed rank's status"""
