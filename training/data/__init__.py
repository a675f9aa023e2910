"""The data of a run, from source to batches: the corpus sources (`sources`), the units a source is cut into and
their preparation and merge (`units`), the validation rules (`validation`), the shard reader (`reader`) and the
online tokenize-and-pack loader whose state each checkpoint saves (`loader`)."""
