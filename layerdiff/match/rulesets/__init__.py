"""Built-in rule sets, one per ecosystem or framework, as plain data in the schema of ``match.rules.from_dict``
(the same as a user's TOML rule file). Each acts only where its module names appear, so all of them are always on."""
from layerdiff.match.rulesets import huggingface, megatron, mindformers, mindspore, operations, paddle

# (name, rules, listed): the model families' sets are named in a report's "rules"; the frameworks' own facts (type
# names, stored layouts) are always on, as the facts of the core they came from were, and are not listed
ALL = (("huggingface", huggingface.RULES, True), ("megatron", megatron.RULES, True),
       ("mindformers", mindformers.RULES, True), ("paddle", paddle.RULES, False), ("mindspore", mindspore.RULES, False),
       ("operations", operations.RULES, False))
