"""``diloco bench``: the modes side by side on the same recipe, seeds, budget and failures."""
