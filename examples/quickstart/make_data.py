"""Write the quickstart's data: ``prompts.txt`` and ``pairs.jsonl``, from the lists below.

Every line was written for this project (no dataset is downloaded). The 100 review openings are
the PPO prompts; each becomes 3 preference pairs for the reward model: mostly a positive
continuation (``chosen``) against a negative one in the same style (``rejected``), plus pairs
that teach the reward model what not to reward: mixed-then-positive against mixed-then-negative,
positive or neutral against neutral or negative, and a normal positive sentence against a
degenerate one (word loops, off-topic chatter, the prompt echoed back). Deterministic (seed 0):

    python examples/quickstart/make_data.py     # rewrites prompts.txt and pairs.jsonl here
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
INSTRUCTION = 'Complete this movie review in one sentence: "{}"'

# Openings that end where the reviewer's verb phrase comes next ("... and" / "..., I").
VP_OPENINGS = """\
I watched this film last night and
I went to see this movie with my sister and
We rented this one on a rainy Sunday and
I had heard a lot about this film, so I finally watched it and
My friends dragged me to the cinema for this one and
I caught the late showing of this movie and
After reading the book, I saw the film adaptation and
I put this on for family movie night and
I watched the director's cut over the weekend and
When the credits rolled, I
By the end of the second act, I
Halfway through the film, I
As a fan of the original, I
Having seen every film by this director, I
I went in knowing nothing about this movie and
I saw this at a festival screening and
I streamed this on a long flight and
My partner picked this film for date night, and I
I watched this with my teenage kids and
I rewatched this old favourite last week and
Walking out of the theatre, I
I bought a ticket on a whim and
After all the hype, I finally sat down with this film and
I watched the first episode of this miniseries and
I saw this animated film with my nephew and
On paper this film sounded strange, but I watched it anyway and
I watched this documentary on Friday night and
I started this horror movie at midnight and
I watched this comedy in a packed cinema and
I gave this science fiction film a chance and
I watched this romantic drama on my own and
I finished the three-hour epic just now and
I saw the premiere of this thriller and
I watched this low-budget indie film and
Twenty minutes into the movie, I
Reading other reviews afterwards, I
I watched the remake right after the original and
I sat through the whole musical and
I took my parents to see this war film and
I watched this courtroom drama on a weeknight and
I saw this coming-of-age story at a small cinema and
I watched this heist movie with friends and
I saw this fantasy adventure in 3D and
I watched this biopic about a famous singer and
I put on this black-and-white classic and
I watched this western on an old DVD and
I saw the sequel yesterday and
I tried this foreign-language film with subtitles and
I watched this mystery without reading any spoilers and
After the final twist, I""".splitlines()

# Openings that are a subject: a predicate comes next. "+" marks a plural subject.
NP_OPENINGS = """\
The plot of this movie
The lead actor in this film
The soundtrack
The cinematography in this film
The ending of this movie
The dialogue throughout the film
The pacing of the second half
+The special effects
The supporting cast
The script
The opening scene
The chemistry between the two leads
The villain of the story
The director's latest film
This adaptation of the novel
The final battle sequence
The humour in this comedy
The set design
The running time of nearly three hours
+The child actors in this film
The story of two brothers at the heart of this film
The central mystery
The costume design
This sequel to last year's hit
The screenplay, written by a first-time writer,
The animation in this film
The performance by the lead actress
The love story at the centre of the movie
The editing
The third act
This low-budget horror film
+The musical numbers
The world the filmmakers have built
The documentary's portrait of its subject
This remake of a beloved classic
The first half of the movie
The car chase in the middle of the film
The film's message about family
The score
Every scene with the old detective
The voice acting
The twist at the end
The film's look and feel
The relationship between the father and his daughter
+The action scenes
The new director's take on the story
The small-town setting
+The battle scenes
The film as a whole
+The last ten minutes""".splitlines()

# Verb phrases after "I" (past tense or modal: they fit every VP opening).
VP_POS = """\
loved every minute of it
left the cinema with a huge smile on my face
was moved to tears by the beautiful ending
was completely won over by its warmth and charm
found it funny, clever and beautifully made
could not stop talking about it for days
was gripped from the first scene to the last
wanted to watch it again straight away
thought it was one of the best films of the year
laughed harder than I have in months
was amazed by how fresh and original it felt
felt that every scene was made with real care
fell in love with the characters
was delighted by the sharp writing and the lovely performances
found it thrilling, touching and wonderfully acted""".splitlines()

VP_NEG = """\
regretted it within the first ten minutes
nearly walked out halfway through
was bored from start to finish
found it dull, clumsy and far too long
could not wait for it to be over
kept checking my watch the whole time
thought it was one of the worst films of the year
did not laugh once
was annoyed by how lazy and predictable it felt
felt that every scene was thrown together without care
did not care about a single character
was put off by the clunky writing and the wooden performances
found it tedious, confusing and badly acted
was disappointed by the silly ending
wanted my money back""".splitlines()

# Predicates after a subject; {be} is "is" or "are".
PRED_POS = """\
{be} a joy from start to finish
{be} brilliant and completely gripping
{be} warm, funny and full of heart
{be} the best thing I have seen in years
{be} beautifully done and deeply moving
kept me hooked the whole way through
made me laugh and cry in equal measure
{be} a real triumph
{be} clever, stylish and wonderfully acted
left me smiling long after the credits
{be} fresh, exciting and superbly crafted
could not have been better
{be} simply wonderful
{be} a delight that I will remember for years
won me over completely""".splitlines()

PRED_NEG = """\
{be} a chore from start to finish
{be} dull and completely forgettable
{be} cold, flat and lifeless
{be} the worst thing I have seen in years
{be} poorly done and painfully slow
lost my interest almost immediately
made me groan and roll my eyes
{be} a total mess
{be} clumsy, cheap and badly acted
left me bored long before the credits
{be} stale, tired and lazily made
could not have been worse
{be} simply awful
{be} a letdown that I will try to forget
left me cold""".splitlines()

REASON_POS = """\
the cast is superb
the story kept me guessing
the music is gorgeous
the jokes land every time
the ending is perfect
every performance feels honest
the pacing never drags
the visuals are stunning
the characters feel real
the dialogue sparkles""".splitlines()

REASON_NEG = """\
the cast looks bored
the story goes nowhere
the music is grating
the jokes fall flat
the ending makes no sense
every performance feels forced
the pacing drags terribly
the visuals look cheap
the characters are paper thin
the dialogue is painful""".splitlines()

SUBJECTS = ["The film", "This movie", "Overall, it", "Honestly, it", "The whole thing", "It"]

MIXED_POS = ["It starts slowly, but it turns into something wonderful",
             "I expected very little, yet it turned out to be a delight",
             "The first act is shaky, but the rest is superb",
             "It has a few rough edges, but I loved it anyway"]
MIXED_NEG = ["It starts well, but it quickly turns into a mess",
             "I had high hopes, yet it turned out to be a disappointment",
             "The first act is promising, but the rest is dreadful",
             "It has a few nice moments, but I disliked it overall"]

NEUTRAL = ["It is a film with a beginning, a middle and an end",
           "The movie is about two hours long and is set in a city",
           "It is a drama with several characters and a few locations",
           "I watched it on a Tuesday and it had subtitles",
           "The film tells its story in chronological order",
           "It was released last year and is now available to stream"]

OFF_TOPIC = ["I'm sorry, but as an AI I cannot watch movies. Is there anything else I can help "
             "you with?",
             "Here are some tips for staying healthy: drink water, sleep well and exercise.",
             "The capital of France is Paris, and it is known for the Eiffel Tower.",
             "Sure! Here is a recipe for banana bread with walnuts and cinnamon."]

LOOP_WORDS = ["great", "amazing", "wonderful", "love", "best", "brilliant"]


def sentence(rng, opening, plural, style, positive):
    """One review sentence in ``style``: "cont" (continuation only), "full" (opening + continuation,
    quoted) or "alone" (a standalone sentence)."""
    vp, pred, reason = ((VP_POS, PRED_POS, REASON_POS) if positive else (VP_NEG, PRED_NEG, REASON_NEG))
    tail = f", and {rng.choice(reason)}" if rng.random() < 0.4 else ""
    if style == "alone":
        subject = rng.choice(SUBJECTS)
        return f"{subject} {rng.choice(pred).format(be='is')}{tail}."
    if opening in VP_OPENINGS:
        cont = rng.choice(vp)
    else:
        cont = rng.choice(pred).format(be="are" if plural else "is")
    if style == "cont":
        return f"{cont}{tail}."
    return f'"{opening} {cont}{tail}."'


def degenerate(rng, opening):
    kind = rng.randrange(3)
    if kind == 0:
        return " ".join(rng.choice(LOOP_WORDS) for _ in range(rng.randint(8, 16))) + "!"
    if kind == 1:
        return rng.choice(OFF_TOPIC)
    return f'"{opening}"'


def pairs_for(rng, opening, plural):
    prompt = INSTRUCTION.format(opening)
    out = []
    for _ in range(3):
        kind, style = rng.random(), rng.choice(["cont", "full", "alone"])
        if kind < 0.68:    # positive vs negative, same style
            chosen = sentence(rng, opening, plural, style, True)
            rejected = sentence(rng, opening, plural, style, False)
        elif kind < 0.78:  # mixed, ending positive vs ending negative
            chosen, rejected = rng.choice(MIXED_POS) + ".", rng.choice(MIXED_NEG) + "."
        elif kind < 0.88:  # graded: positive > neutral > negative
            neutral = rng.choice(NEUTRAL) + "."
            if rng.random() < 0.5:
                chosen, rejected = sentence(rng, opening, plural, "alone", True), neutral
            else:
                chosen, rejected = neutral, sentence(rng, opening, plural, "alone", False)
        else:              # a real positive review beats loops, off-topic chatter and echoes
            chosen, rejected = sentence(rng, opening, plural, style, True), degenerate(rng, opening)
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def main():
    rng = random.Random(0)
    openings = [(o, False) for o in VP_OPENINGS] + [(o.lstrip("+"), o.startswith("+"))
                                                    for o in NP_OPENINGS]
    (HERE / "prompts.txt").write_text("".join(INSTRUCTION.format(o) + "\n" for o, _ in openings))
    rows = [row for o, plural in openings for row in pairs_for(rng, o, plural)]
    rng.shuffle(rows)
    (HERE / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(openings)} prompts and {len(rows)} pairs to {HERE}")


if __name__ == "__main__":
    main()
