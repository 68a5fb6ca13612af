"""The code mlflow logs as the model ("models from code"): it names the class, and pickles nothing.

mlflow runs a copy of this file when the model is loaded; the class comes from the installed `pipeline`
package, so the serving environment needs `pipeline` importable (`--env-manager local`).
"""
from mlflow.models import set_model

from pipeline.serving.checkpoint_model import CheckpointModel

set_model(CheckpointModel())
