"""The code mlflow logs as a MiniGPT model ("models from code"), run when it loads: it names the class, pickles
nothing; its predict's type (Row) is what mlflow checks each row against."""

# The class comes from the installed package: serving needs `pipeline` importable (`--env-manager local`).
from mlflow.models import set_model

from pipeline.serving.checkpoint_model import GeneratorModel

set_model(GeneratorModel())
