"""Console entry points (pyproject [project.scripts])."""
