"""Training prompts for self-distillation, generated from templates x topics.

The heads learn to predict the target's own answers, so what matters is that the prompts cover the
kinds of requests a chat model gets (chat, explanation, translation, summarization, question
answering over a passage, math word problems, code, rewriting), not that they are hand-written. All
of them are built here from small word lists by a seeded generator; none comes from a dataset, and
none from the held-out benchmark prompts (`benchmarks/prompts/real.json`), which are never read by
training code.
"""

from __future__ import annotations

import random

TOPICS = (
    "volcanoes", "the water cycle", "black holes", "honey bees", "the Roman Empire", "electric cars",
    "coral reefs", "the printing press", "vaccines", "solar panels", "the human heart", "glaciers",
    "the stock market", "chess", "jazz music", "the Silk Road", "rainforests", "earthquakes",
    "recycling", "the moon landing", "dinosaurs", "photosynthesis", "the internet", "coffee",
    "the Great Wall of China", "bicycles", "sleep", "tides", "the French Revolution", "bread baking",
    "wind turbines", "octopuses", "the immune system", "inflation", "the Olympic Games", "origami",
    "the periodic table", "migratory birds", "compound interest", "public libraries", "tea",
    "deserts", "the Renaissance", "submarines", "mushrooms", "lighthouses", "climate change",
    "the piano", "ancient Egypt", "batteries", "penguins", "the Amazon river", "gardening",
    "machine learning", "the telescope", "maps", "friendship", "meditation", "rivers", "trains",
)

PEOPLE = ("a student", "a retired teacher", "a nurse", "a software engineer", "a farmer", "a chef",
          "a child", "a tourist", "a small business owner", "a librarian", "an artist", "a runner")

EXPLAIN = (
    "Explain {topic} in simple terms.", "What should everyone know about {topic}?",
    "Give me three interesting facts about {topic}.", "How would you explain {topic} to {person}?",
    "Why is {topic} important?", "Describe the history of {topic} briefly.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a short paragraph about {topic}.", "What is a common misconception about {topic}?",
    "Compare {topic} and {other}. How are they similar and how are they different?",
)

CHAT = (
    "I'm {person} and I want to learn about {topic}. Where should I start?",
    "Can you suggest a weekend plan for someone who loves {topic}?",
    "My friend keeps talking about {topic}. What questions could I ask them?",
    "Write a short poem about {topic}.", "Tell me a short story about {person} and {topic}.",
    "Give me some tips for {activity}.", "I feel nervous about {activity}. Any advice?",
    "What are good habits for {activity}?", "Write a friendly email inviting a colleague to {event}.",
    "Help me write a thank-you note to {person} who helped me with {activity}.",
    "What are five fun things to do on a rainy day?", "Suggest a name for a cafe about {topic}.",
)

ACTIVITIES = ("learning a new language", "running a marathon", "public speaking", "cooking dinner",
              "studying for exams", "moving to a new city", "starting a garden", "saving money",
              "writing a novel", "job interviews", "traveling alone", "learning to swim")

EVENTS = ("a team lunch", "a book club meeting", "a charity run", "a birthday party",
          "a workshop on {topic}", "a picnic in the park")

SENTENCES = (
    "The weather is nice today.", "I would like a cup of coffee, please.",
    "Where is the nearest train station?", "My brother lives in a small town near the sea.",
    "The library opens at nine in the morning.", "We are going to the market tomorrow.",
    "This book is about {topic}.", "She has been learning to play the piano for two years.",
    "Could you help me find my keys?", "The children are playing in the garden.",
    "I think {topic} is fascinating.", "Dinner will be ready in twenty minutes.",
)

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")

TRANSLATE = (
    "Translate into {lang}: \"{sentence}\"", "How do you say \"{sentence}\" in {lang}?",
    "Translate this sentence to {lang} and explain any tricky words: {sentence}",
)

FACTS = (
    "{Topic} has been studied for many years by scientists and historians.",
    "Many people first learn about {topic} at school, but few understand it well.",
    "Experts say that {topic} affects daily life in ways that are easy to miss.",
    "In recent decades, new tools have changed how researchers look at {topic}.",
    "One town even holds a yearly festival dedicated to {topic}.",
    "Critics argue that the popular picture of {topic} is too simple.",
    "A report published last year found that interest in {topic} grew by {pct} percent.",
    "The first detailed description of {topic} was written about {years} years ago.",
    "Teachers often use {topic} to show how different subjects connect.",
    "Some of the most important questions about {topic} are still open.",
)

PASSAGE_TASKS = (
    "Summarize the following text in two sentences.\n\n{passage}",
    "Read the passage and list its main points.\n\n{passage}",
    "{passage}\n\nWrite a one-sentence summary of the text above.",
    "Based on the passage below, by how much did interest in {topic} grow?\n\n{passage}",
    "Passage: {passage}\n\nQuestion: What do critics argue about {topic}?",
    "Here is a short text:\n{passage}\n\nWhat is the main idea, and who is it written for?",
)

MATH = (
    "{name} has {a} apples and buys {b} more. Then {name} gives away {c}. How many apples are "
    "left? Explain step by step.",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "A shop sells pens at {b} dollars each. How much do {a} pens cost, and how much change is "
    "there from {d} dollars?",
    "{name} reads {b} pages a day. How many days to finish a book of {a} pages?",
    "What is {a} plus {b} times {c}? Show your work.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If {c} workers build a wall in {b} days, how long would {d} workers take?",
    "{name} saves {b} dollars a week. How many weeks until {name} has {a} dollars?",
)

NAMES = ("Maria", "Tom", "Aisha", "Kenji", "Lena", "Omar", "Sofia", "Lucas", "Priya", "Noah")

CODE = (
    "Write a Python function that {task}.", "How do I {task} in Python?",
    "Write a JavaScript function that {task}.",
    "Explain what this code does:\n\n```python\n{snippet}\n```",
    "Find the bug in this function and fix it:\n\n```python\n{snippet}\n```",
    "Write a unit test for a function that {task}.",
)

CODE_TASKS = ("reverses a string", "checks whether a number is prime", "counts the words in a text",
              "returns the largest element of a list", "merges two sorted lists",
              "removes duplicates from a list", "computes the factorial of n",
              "converts Celsius to Fahrenheit", "reads a CSV file and sums a column",
              "checks whether a string is a palindrome", "finds the nth Fibonacci number",
              "flattens a nested list", "counts vowels in a string", "sorts a dictionary by value")

SNIPPETS = (
    "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s",
    "def average(xs):\n    return sum(xs) / len(xs) + 1",
    "def is_even(n):\n    return n % 2 == 1",
    "def greet(name):\n    print('Hello, ' + name)\n    return len(name)",
    "def last(xs):\n    return xs[len(xs)]",
    "def square_all(xs):\n    return [x * x for x in xs]",
)

REWRITE = (
    "Rewrite this sentence to sound more formal: \"{sentence}\"",
    "Make this sentence shorter: \"{sentence}\"", "Correct the grammar: \"{bad}\"",
    "Give three synonyms for the word \"{word}\" and use each in a sentence.",
)

BAD = ("me and him goes to the store yesterday", "she don't like apples", "their going too fast",
       "i has three cat", "we was happy to seen you")

WORDS = ("happy", "fast", "important", "beautiful", "difficult", "small", "bright", "calm")

CATEGORIES = ("explain", "chat", "translate", "passage", "math", "code", "rewrite", "multi_turn")


def _passage(rng: random.Random, topic: str) -> str:
  facts = rng.sample(FACTS, 4)
  fill = dict(topic=topic, Topic=topic[0].upper() + topic[1:], pct=rng.randint(5, 60),
              years=rng.choice((80, 150, 200, 300, 500)))
  return " ".join(f.format(**fill) for f in facts)


def _user_turn(rng: random.Random, category: str) -> str:
  topic = rng.choice(TOPICS)
  fill = dict(topic=topic, other=rng.choice(TOPICS), person=rng.choice(PEOPLE),
              activity=rng.choice(ACTIVITIES), name=rng.choice(NAMES), lang=rng.choice(LANGUAGES),
              task=rng.choice(CODE_TASKS), snippet=rng.choice(SNIPPETS), word=rng.choice(WORDS),
              bad=rng.choice(BAD), a=rng.randint(12, 480), b=rng.randint(2, 12),
              c=rng.randint(2, 9), d=rng.randint(3, 20))
  fill["event"] = rng.choice(EVENTS).format(topic=topic)
  fill["sentence"] = rng.choice(SENTENCES).format(topic=topic)
  fill["passage"] = _passage(rng, topic)
  template = {"explain": EXPLAIN, "chat": CHAT, "translate": TRANSLATE, "passage": PASSAGE_TASKS,
              "math": MATH, "code": CODE, "rewrite": REWRITE}[category]
  return rng.choice(template).format(**fill)


def training_conversations(count: int, seed: int = 0) -> list[list[dict]]:
  """`count` conversations (lists of {role, content} messages ending with a user turn).

  Args:
    count: number of conversations.
    seed: the generator's seed; the same seed gives the same list.

  Returns:
    Conversations cycling through `CATEGORIES`; "multi_turn" ones hold a made-up first exchange
    (a user turn and a short canned assistant reply) and a follow-up question.
  """
  rng = random.Random(seed)
  out = []
  for i in range(count):
    category = CATEGORIES[i % len(CATEGORIES)]
    if category == "multi_turn":
      first = _user_turn(rng, rng.choice(("explain", "chat", "code")))
      follow = rng.choice(("Can you give an example?", "Can you make that shorter?",
                           "Why is that?", "What would you recommend for a beginner?",
                           "Can you explain that to a ten-year-old?", "Thanks! What else?"))
      reply = rng.choice(("Sure, here is a short overview.", "Of course. In short, it depends on "
                          "the details, but the main idea is simple.", "Happy to help with that."))
      out.append([{"role": "user", "content": first}, {"role": "assistant", "content": reply},
                  {"role": "user", "content": follow}])
    else:
      out.append([{"role": "user", "content": _user_turn(rng, category)}])
  return out
