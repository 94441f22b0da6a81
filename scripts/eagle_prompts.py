"""The self-distillation prompt set of the EAGLE head: templates x topics, written here.

Six kinds of request, like the benchmark set (open writing, QA, math, code,
summarisation of a passage, retrieval-style quoting), but with other topics and
passages, so `scripts/spec_prompts.py` stays held out. Deterministic for a seed. It does
not know the tokenizer, the model, or how answers are generated.
"""

from __future__ import annotations

import random

TOPICS = (
    "volcanoes", "the history of the bicycle", "photosynthesis", "coral reefs", "the printing press",
    "black holes", "sourdough bread", "the Roman aqueducts", "honey and beekeeping", "glaciers",
    "the invention of the telephone", "rainforests", "chess", "the water cycle", "electric cars",
    "the Silk Road", "migrating birds", "the human heart", "solar panels", "ancient Egypt",
    "jazz music", "earthquakes", "vaccines", "the Moon landing", "recycling plastic",
    "octopuses", "the Great Wall of China", "coffee", "tides", "the internet",
    "dinosaurs", "wind turbines", "the immune system", "origami", "deserts",
    "the Olympic Games", "submarines", "mushrooms", "the French Revolution", "rainbows",
    "penguins", "3D printing", "the stock market", "tea ceremonies", "lightning",
    "libraries", "the Amazon river", "robots in factories", "sleep", "maps and cartography",
    "the telescope", "wolves", "ocean currents", "the Renaissance", "bread baking at home",
    "hurricanes", "the Eiffel Tower", "whales", "the steam engine", "composting",
    "the metric system", "spiders", "the Vikings", "batteries", "owls",
    "the Industrial Revolution", "snowflakes", "trains", "the human brain", "kites",
    "the Sahara desert", "nuclear power", "elephants", "the Mayan civilisation", "bridges",
    "clouds", "the violin", "antibiotics", "the Arctic", "skyscrapers",
    "butterflies", "the printing of money", "climate change", "hot air balloons", "ants",
    "the Pyramids of Giza", "microscopes", "gardening", "satellites", "the piano",
    "rivers", "the Wright brothers", "cheese making", "volunteering", "bats",
    "the postal service", "magnets", "the ancient Greeks", "board games", "dolphins",
    "fire fighting", "volcanic islands", "the Roman Empire", "tornadoes", "sharks",
    "wind and sailing ships", "the camera", "vegetarian cooking", "mountain climbing", "frogs",
    "the periodic table", "castles", "public transport", "the Northern Lights", "knitting",
    "the heart of a city park", "space stations", "caves", "running a marathon", "salt",
    "the history of writing", "parrots", "rain gauges and weather stations", "video games", "forests in winter",
    "the compass", "tigers", "learning a new language", "the Mediterranean Sea", "windmills",
    "the first aeroplanes", "coral islands", "clocks", "chocolate", "horses",
    "museums", "earthworms", "the Great Barrier Reef", "paper making", "saving money",
)

OPEN_WRITING = (
    "Write a short story about {topic}.",
    "Write a poem about {topic}.",
    "Write a blog post introduction about {topic}.",
    "Write a letter to a friend describing a day spent learning about {topic}.",
    "Describe {topic} as if you were a tour guide.",
    "Write a short speech for a school assembly about {topic}.",
    "Write a diary entry by someone who has just discovered {topic}.",
    "Write a short news report about a new exhibition on {topic}.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "Write an email to a colleague suggesting a team outing related to {topic}.",
)

QA = (
    "What is {topic}? Explain it simply.",
    "Give me five interesting facts about {topic}.",
    "Why is {topic} important? Answer in a paragraph.",
    "Explain {topic} to a ten-year-old.",
    "What are the main advantages and disadvantages of {topic}?",
    "How has {topic} changed over time?",
    "What are some common misconceptions about {topic}?",
    "Explain step by step how {topic} works.",
    "Write a short quiz with answers about {topic}.",
    "What should a beginner know about {topic}?",
)

CODE_TASKS = (
    "reverses a list without using built-in reverse functions",
    "counts how many vowels are in a string",
    "checks whether a number is prime",
    "returns the largest element of a list",
    "merges two sorted lists into one sorted list",
    "computes the factorial of n recursively",
    "removes duplicates from a list while keeping the order",
    "converts a temperature from Celsius to Fahrenheit",
    "counts the words in a sentence",
    "finds the second smallest number in a list",
    "checks whether two strings are anagrams",
    "computes the sum of the digits of an integer",
    "finds the longest word in a sentence",
    "converts a binary string to an integer",
    "flattens a nested list",
    "returns the common elements of two lists",
    "capitalises the first letter of every word",
    "computes the average of a list of numbers",
    "checks whether a year is a leap year",
    "rotates a list by k positions",
    "counts the lines in a text file",
    "finds the greatest common divisor of two numbers",
    "sorts a list of dictionaries by a given key",
    "checks whether brackets in a string are balanced",
)
CODE = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}, and explain how it works.",
    "Write a JavaScript function that {task}.",
    "Write a Python function with a docstring that {task}, and show an example call.",
    "Write a Python function that {task}, and add unit tests for it.",
    "Explain how you would write a program that {task}, then write it in Python.",
)

PASSAGES = (
    "The town of Ellery sits where two rivers meet. In 1820 a mill was built on the east bank, "
    "and within thirty years the town had a school, two churches and a weekly market. When the "
    "railway arrived in 1868 the mill closed, because flour from larger mills could now be brought "
    "in cheaply. The building stood empty until 1921, when it was turned into a library. Today the "
    "library holds forty thousand books and a small museum about the history of the mill.",
    "Tardigrades are tiny animals, usually less than a millimetre long, that live in moss, soil and "
    "the sea. They can survive being dried out for years by entering a state called cryptobiosis, "
    "in which their metabolism almost stops. In experiments they have survived extreme cold, high "
    "pressure and even the vacuum of space. When water returns, they rehydrate and walk away within "
    "hours. Scientists study them to learn how cells can be protected from damage.",
    "The first public electric street lights in the city were switched on in 1882. They were arc "
    "lamps, very bright but noisy and expensive to run, so only the main square had them at first. "
    "Over the next twenty years incandescent bulbs replaced the arc lamps, and the lighting spread "
    "to the side streets. Shopkeepers found that customers stayed out later, and the evening market "
    "became the busiest time of the week. By 1910 almost every street had electric light.",
    "Maria trained for the marathon for six months. She ran four times a week, slowly increasing "
    "the distance of her long Sunday run from ten to thirty kilometres. Two weeks before the race "
    "she injured her ankle and had to rest. On race day she started slowly, walked through every "
    "water station and finished in four hours and twelve minutes, twenty minutes slower than her "
    "goal but, as she said afterwards, the happiest finish of her life.",
    "Compost is made when microorganisms break down plant material such as leaves, grass and "
    "vegetable scraps. A good compost heap needs a mix of green material, which is rich in "
    "nitrogen, and brown material, which is rich in carbon. It also needs air and moisture: a heap "
    "that is too wet smells bad, and one that is too dry stops working. Turning the heap every few "
    "weeks speeds up the process, and finished compost is dark, crumbly and smells like soil.",
    "The observatory was built on the mountain in 1957 because the air there is dry and still. Its "
    "main telescope has a mirror two metres across. In the 1970s astronomers used it to measure "
    "the speed of distant galaxies, and in 1994 it recorded the impact of a comet on Jupiter. Light "
    "from the growing town below now makes some observations difficult, so the town has agreed to "
    "use shielded street lamps that point their light downwards.",
    "Glass has been made in the town of Hollin since 1610, when two families from Venice settled "
    "beside the river. They used sand from the dunes and ash from burnt seaweed, and their furnaces "
    "burned day and night. By 1800 eleven workshops employed four hundred people, most of them "
    "making bottles. Only one workshop survives today. It makes coloured bowls by hand, and "
    "visitors can watch the glassblowers from a gallery above the furnace.",
    "Bamboo is a grass, not a tree, although some kinds grow taller than a house. Certain species "
    "can grow almost a metre in a single day, which makes bamboo one of the fastest growing plants "
    "on Earth. Because it regrows quickly after cutting, it is used for scaffolding, furniture, "
    "flooring and even bicycles. Many bamboo species flower only once every few decades, and then "
    "all the plants of that species flower at the same time and die.",
    "The village school had only one classroom when it opened in 1903. Pupils from the age of five "
    "to fourteen sat together, and the teacher lived in two rooms at the back of the building. A "
    "second classroom was added in 1936, and electric lights in 1948. The school closed in 1989 "
    "when the pupils moved to a larger school in the next town. The building is now the village "
    "hall, where a photograph of the first class still hangs by the door.",
    "Sea otters spend almost their whole lives in the water. Unlike most marine mammals they have "
    "no layer of blubber, so they rely on the thickest fur of any animal to stay warm. They eat sea "
    "urchins, crabs and clams, often floating on their backs and using a stone to crack open shells. "
    "By eating sea urchins they protect kelp forests, which urchins would otherwise destroy. For "
    "this reason they are called a keystone species.",
    "In March the city council voted to close Harbour Street to cars on weekends. Traders worried "
    "that fewer people would come to their shops, but by the end of the summer most reported higher "
    "sales than the year before. The council counted twice as many people walking on the street on "
    "Saturdays. Some residents still complained about noise from outdoor cafes late at night, and "
    "the council agreed to review the opening hours in the autumn.",
    "A sundial tells the time from the shadow cast by a pointer called a gnomon. For the dial to be "
    "accurate, the gnomon must point towards the celestial pole, so its angle depends on the "
    "latitude of the place where the dial stands. Sundials show solar time, which can differ from "
    "clock time by up to sixteen minutes during the year. Before mechanical clocks were common, "
    "towns set their church clocks by the sundial at noon.",
)
SUMMARISE = (
    "Summarise the following passage in two sentences.\n\n{passage}",
    "Summarise this text in one paragraph.\n\n{passage}",
    "Give three bullet points that summarise the passage below.\n\n{passage}",
    "What is the main idea of this passage?\n\n{passage}",
    "{passage}\n\nSummarise the passage above in three sentences.",
    "Explain this passage to a child in a few sentences.\n\n{passage}",
    "{passage}\n\nWrite a one-sentence summary of this text, then list its key facts.",
    "Rewrite the following passage as a short summary for a newsletter.\n\n{passage}",
)
QUOTE = (
    "Quote the first two sentences of the passage below exactly.\n\n{passage}",
    "Copy the last sentence of this passage word for word.\n\n{passage}",
    "Find the sentence that mentions a year and quote it exactly.\n\n{passage}",
    "Repeat the passage below, then give it a title.\n\n{passage}",
    "Quote the sentence of this passage that you find most surprising, exactly as written.\n\n{passage}",
    "{passage}\n\nQuote the second and third sentences of this passage word for word.",
    "{passage}\n\nWhich sentences mention a number? Copy them exactly.",
    "Repeat this passage exactly, then say in one sentence what it is about.\n\n{passage}",
    "{passage}\n\nCopy the passage above, then list the people or places it names.",
)

MATH = (
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost? Show your working.",
    "Solve for x: {a}x + {b} = {c}. Explain each step.",
    "A car travels {a} km in {b} hours. What is its average speed?",
    "What is {a} multiplied by {b}? Explain how you calculated it.",
    "Sara has {c} apples. She gives {a} to her friend and buys {b} more. How many apples does she have now?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "What is {a} percent of {c}? Show the steps.",
    "A tank holds {c} litres and fills at {a} litres per minute. How long does it take to fill? Explain.",
    "Tom is {a} years old and his sister is {b} years older. How old will she be in {a} years?",
    "A class of {c} students is split into groups of {a}. How many full groups are there, and how many students are left over?",
    "A ticket costs {a} dollars and a family buys {b} tickets with a {a} percent discount. What do they pay?",
)


def build_prompts(seed: int = 0) -> list[tuple[str, str]]:
    """(category, user prompt) pairs, shuffled deterministically: every template x topic
    for open writing and QA, every template x task for code, every template x passage
    for summarisation and quoting, and seeded numbers for math."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for topic in TOPICS:
        out.extend(("open_writing", template.format(topic=topic)) for template in OPEN_WRITING)
        out.extend(("qa", template.format(topic=topic)) for template in QA)
    for task in CODE_TASKS:
        for template in CODE:
            out.append(("code", template.format(task=task)))
    for passage in PASSAGES:
        for template in SUMMARISE:
            out.append(("summarisation", template.format(passage=passage)))
        for template in QUOTE:
            out.append(("quoting", template.format(passage=passage)))
    for _ in range(360):
        a, b = rng.randint(2, 60), rng.randint(2, 30)
        out.append(("math", rng.choice(MATH).format(a=a, b=b, c=a * rng.randint(2, 9) + b)))
    rng.shuffle(out)
    return out


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]
