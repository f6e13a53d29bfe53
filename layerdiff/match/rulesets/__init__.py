"""Built-in rule sets, one per ecosystem or framework, as plain data in the schema of ``match.rules.from_dict``
(the same as a user's TOML rule file). Each acts only where its module names appear, so all of them are always on."""
from layerdiff.match.rulesets import huggingface, megatron, mindformers, mindspore, paddle

ALL = (("huggingface", huggingface.RULES), ("megatron", megatron.RULES), ("mindformers", mindformers.RULES),
       ("paddle", paddle.RULES), ("mindspore", mindspore.RULES))
