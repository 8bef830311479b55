"""``python -m scalerlt_mcore.train``: the main job's entry (see ``scalerlt_mcore.app.train``)."""

from scalerlt_mcore.app.train import cli

if __name__ == "__main__":
    cli()
