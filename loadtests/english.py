"""English prompts for serving benchmarks: a committed list of plain sentences, and seeded
prompts built from it.

The sentences are ordinary prose (weather, travel, cooking, work, small histories), written
for this project. A prompt is a run of whole sentences, in a seeded order, cut at a word
boundary near a seeded target length; prompt `i` starts with its own sentence, so the
prompts of one set are distinct from their first words on. Lengths are targets in tokens,
turned into characters at `chars_per_token` (4.77 for SmolLM2's tokenizer on this text).
With the defaults and the serving benchmark's tag ("Request 17. ") every prompt of seed 0
is 28 to 189 SmolLM2 tokens; the server's `usage.prompt_tokens` is the measured length.
"""

from __future__ import annotations

import random

SENTENCES = (
    "The morning train left the station ten minutes late because of a signal fault near the bridge.",
    "She kept a small notebook in her coat pocket and wrote down the names of every bird she saw.",
    "By the time the rain stopped, the river had risen almost to the top of the old stone wall.",
    "The bakery on the corner opens at six, and there is usually a queue before the lights come on.",
    "He spent the whole afternoon trying to fix the bicycle chain, and in the end he bought a new one.",
    "Most of the village gathered in the square when the results of the election were read aloud.",
    "The recipe calls for two cups of flour, a pinch of salt and enough warm water to make a soft dough.",
    "After three days of walking, they reached a hut where an old shepherd offered them bread and cheese.",
    "The library moved to a larger building last year, but many readers still miss the creaking floors.",
    "Our neighbour grows tomatoes on the balcony and gives away more than his family can ever eat.",
    "The meeting was meant to last half an hour, yet nobody left the room until well after lunch.",
    "A strong wind blew across the harbour, and the small boats pulled hard against their ropes.",
    "When the power went out, we lit candles and played cards at the kitchen table until midnight.",
    "The museum has a room full of clocks, and every hour they all chime at slightly different times.",
    "Nobody could remember who had planted the apple tree, but everyone agreed it gave the best fruit.",
    "The new bridge will shorten the journey to the city by almost twenty minutes each way.",
    "She learned to swim at the age of forty and now crosses the lake every summer morning.",
    "The soup tasted better on the second day, once the herbs had time to soften and blend.",
    "Snow fell all night, and by dawn the road to the farm had disappeared under a white blanket.",
    "The teacher asked each pupil to bring one object from home and explain why it mattered to them.",
    "Their shop sells maps, compasses and old travel guides that describe countries which no longer exist.",
    "The ferry crossing was rough, and most passengers spent it holding on to the rail in silence.",
    "He wrote letters to his grandmother every week, even after she had moved into the house next door.",
    "A good pair of boots is worth more on a long walk than any amount of clever equipment.",
    "The festival began with a parade of drums, followed by dancers in bright red and yellow costumes.",
    "The cat sleeps on the warm stones by the stove and refuses to move for anyone but the cook.",
    "Every spring the town cleans the canal, and every spring someone finds a bicycle at the bottom.",
    "The doctor told him to rest for a week, so he read four novels and learned to bake bread.",
    "They painted the fence blue, although the instructions on the tin had promised a shade of green.",
    "The orchestra rehearsed the final movement again and again until the conductor finally smiled.",
    "On clear nights you can see the lights of the island from the top of the hill behind the church.",
    "The market sells fish in the morning and flowers in the afternoon, from the very same stalls.",
    "My brother keeps bees at the bottom of the garden and sells the honey to the shop in the village.",
    "The hotel had no lift, so the porter carried our cases up five flights of narrow stairs.",
    "It took the builders two years to repair the roof of the cathedral after the great storm.",
    "She always orders the same dish at the restaurant, and the waiter no longer brings her a menu.",
    "The old road follows the valley, while the new one cuts straight through the hills in tunnels.",
    "Children were flying kites on the beach, and one of them had tied a long ribbon to the tail.",
    "The factory closed in the spring, and the workers set up a cooperative to make furniture instead.",
    "He measured the room twice before ordering the carpet, and it still arrived a little too short.",
    "The forecast promised sunshine, but a thick fog rolled in from the sea just after breakfast.",
    "Each summer the family rents the same cottage, with the same view of the same quiet bay.",
    "The professor spoke for an hour without notes and answered every question from the audience.",
    "Apples keep well through the winter if you store them in a cool, dark and dry place.",
    "The path to the waterfall is steep and muddy, so most visitors turn back before the last bend.",
    "A young couple bought the empty mill by the river and turned it into a small guest house.",
    "The radio played old songs all evening while we painted the walls of the new flat.",
    "In the museum shop you can buy postcards of paintings that are kept in storage and never shown.",
    "The farmer checks the sky every evening and decides by the colour of the clouds when to harvest.",
    "Our train was cancelled, so we shared a taxi with a musician who was late for his own concert.",
    "The garden was planted so that something is in flower in every month of the year.",
    "The climbers left the hut before sunrise to reach the summit while the snow was still hard.",
    "He keeps his tools in a wooden chest that once belonged to a ship's carpenter.",
    "The school play was a great success, even though the scenery fell over during the second act.",
    "She translated the letter slowly, looking up every third word in a dictionary older than herself.",
    "The lighthouse keeper retired last year, and now the lamp is switched on by a machine.",
    "In autumn the woods are full of people looking for mushrooms, each with a secret favourite place.",
    "The bus driver knew every passenger by name and waited for those who were running late.",
    "They walked along the cliffs until the path ended at a gate with a sign asking them to go back.",
    "The bread came out of the oven with a dark crust, and the whole house smelled of it for hours.",
    "A committee was formed to plan the anniversary, and it met every Tuesday for a year.",
    "The castle was built on a rock above the river, where it could watch every boat that passed.",
    "He learned to play the violin from recordings, and only later found a teacher in the city.",
    "The street was closed for the market, so the cars queued along the main road instead.",
    "Our guide explained that the frescoes had been hidden under plaster for nearly three centuries.",
    "The station clock has shown the wrong time for years, and nobody in town seems to mind.",
    "When the tide goes out, you can walk across the sand to the little island and its ruined chapel.",
    "The café serves breakfast all day, which suits the students who rarely rise before noon.",
    "She repaired the old radio with parts from three others and a good deal of patience.",
    "The hills were covered in heather, and the air smelled of rain that had not yet fallen.",
    "The council decided to plant a hundred trees along the avenue where the old elms once stood.",
    "He always carries an umbrella, and it has rained on every day that he left it at home.",
    "The choir sang in the open air, and their voices carried across the water to the far shore.",
    "Every house on the street has a different coloured door, and ours is the yellow one.",
    "The expedition returned with drawings of plants that no one in the country had seen before.",
    "Fresh peas from the garden need nothing more than a little butter and a few leaves of mint.",
    "The night porter told us stories about the famous guests who had stayed in the hotel long ago.",
    "They cleared the attic and found a box of photographs of people nobody could name.",
    "The river is wide and slow here, and in summer the cows stand in the shallows to keep cool.",
    "The shop assistant wrapped the present in brown paper and tied it with a piece of red string.",
    "A storm in the mountains can arrive in minutes, so walkers are told to carry warm clothes.",
    "The carpenter said the table would take a month, and it was finished in exactly thirty days.",
    "Our grandfather taught us to fish on the lake, and he never once seemed to catch anything.",
    "The village hall hosts a film every Friday, chosen by a different family each week.",
    "The road was lined with poplars, and their shadows striped the fields in the evening sun.",
    "She kept the letters in a tin box under the bed and read them again whenever she felt low.",
    "The harbour master raised a red flag, and the fishing boats stayed in port for the day.",
    "After the flood, the families worked together to dry out the houses and rebuild the walls.",
    "The little train climbs the mountain so slowly that walkers sometimes reach the top before it.",
    "He planted the seeds too early, and a late frost took every one of the young shoots.",
    "The bookshop owner recommends one book to each customer and is almost never wrong.",
    "In the evening the square fills with families, and children chase pigeons around the fountain.",
    "The old mill wheel still turns, although it has not ground any corn for fifty years.",
    "We waited at the crossing while a long goods train rumbled past, loaded with timber.",
    "The wedding was held in the orchard, and the guests sat on benches under the trees.",
    "The letter arrived three weeks late, with a stamp from a country she had never visited.",
)


def prompt_set(seed: int = 0, count: int = 64, lo: int = 22, hi: int = 186,
               chars_per_token: float = 4.77) -> list[str]:
    """`count` distinct prompts with target lengths drawn uniformly in [lo, hi] tokens.

    Prompt i opens with its own sentence (count must not exceed the number of sentences), then
    takes further sentences in a seeded order until its target is reached, the last one cut
    at a word boundary. The same arguments give the same prompts on every machine."""
    if count > len(SENTENCES):
        raise ValueError(f"at most {len(SENTENCES)} distinct prompts (one opening sentence each)")
    longest = int(sum(len(s) + 1 for s in SENTENCES) / chars_per_token)
    if not 1 <= lo <= hi <= longest:
        raise ValueError(f"prompt lengths {lo}-{hi} tokens: give 1 <= low <= high <= {longest} "
                         f"(every sentence once, at {chars_per_token:g} characters a token)")
    rng = random.Random(f"poot:english:{seed}")
    openings = list(range(len(SENTENCES)))
    rng.shuffle(openings)
    prompts = []
    for i in range(count):
        target_chars = int(round(rng.randint(lo, hi) * chars_per_token))
        order = [j for j in range(len(SENTENCES)) if j != openings[i]]
        rng.shuffle(order)
        words: list[str] = []
        size = 0
        for j in [openings[i]] + order:
            for w in SENTENCES[j].split():
                if size + len(w) + (1 if words else 0) > target_chars and words:
                    break
                size += len(w) + (1 if words else 0)
                words.append(w)
            else:
                continue
            break
        prompts.append(" ".join(words))
    return prompts
