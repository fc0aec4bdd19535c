"""python eval.py: the command line of fastllama/eval.py, where the code is."""
from fastllama.eval import cli

if __name__ == "__main__":
    cli()
