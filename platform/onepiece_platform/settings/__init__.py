"""Settings split as cookiecutter-django does: base, local, test, production."""
