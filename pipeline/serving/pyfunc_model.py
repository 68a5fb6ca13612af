"""The code mlflow logs as the model ("models from code"), run when it loads: it names the class, pickles nothing."""

# The class comes from the installed package: serving needs `pipeline` importable (`--env-manager local`).
from mlflow.models import set_model

from pipeline.serving.checkpoint_model import CheckpointModel

set_model(CheckpointModel())
