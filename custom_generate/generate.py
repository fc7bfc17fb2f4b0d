"""spec_adapt as a transformers generation method, in the `custom_generate/` folder convention of Hub repositories:

    model.generate(**inputs, custom_generate="<path of a spec_adapt clone>", trust_remote_code=True,
                   assistant_model=draft, assistant_policy=policy)

transformers hands this function every argument `generate` was given; it passes them on to `model.generate` with
spec_adapt's own generation function, so the usual input preparation runs first. A draft may be given as
`assistant_model` or `drafter`; without `assistant_policy` the process's default policy is used.
"""

import spec_adapt


def generate(model, **generate_arguments):
    # Passed on as given: None is either generate's own default or an explicit choice (eos_token_id=None).
    arguments = dict(generate_arguments)
    draft = arguments.pop("assistant_model", None)
    if draft is not None and arguments.get("drafter") is not None:
        raise ValueError("Pass the draft as assistant_model or as drafter, not both.")
    if draft is not None:
        arguments["drafter"] = draft
    inputs = arguments.pop("inputs", None)
    return model.generate(inputs, custom_generate=spec_adapt.generate, **arguments)
