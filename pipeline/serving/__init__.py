"""A checkpoint as an mlflow pyfunc model, logged from code (never a pickle); see pipeline/register.py."""
