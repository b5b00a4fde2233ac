"""The step runtime: the train state and its call scope, the phases and how they compute,
the step record, its driver and its accumulation window.

Private: transforms and users import the public faces (``fasttorch.state``,
``fasttorch.phases``, ``fasttorch.steps``, ``fasttorch.window``), which re-export what
they need from here. Nothing here imports a transform.
"""
