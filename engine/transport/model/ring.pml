/*
 * ring.pml -- Promela model of the zero-loss MPSC double ring buffer.
 *
 * This is the protocol of docs/ring-protocol.md ("Producer" steps 1-7,
 * "Consumer", HEAD advance, go-back-N), checked by spin in
 * tests/engine/transport/test_model_check.py.  Comments of the form
 * "[P3]" refer to producer step 3 of the doc, "[C]" to the consumer section.
 *
 * Abstractions (see also the "Model checking" section of the doc):
 *  - bytes are 64-byte *units*; the buffer is NBUF units; counters are
 *    logical (only grow) and physical positions are `x % NSLOT`/`x % NBUF`;
 *  - a record's payload is modelled as a per-unit *stamp* (producer, seq):
 *    the checksum is ideal (it fails exactly when some unit of the record
 *    does not carry the header's stamp, or when a bit flip is injected);
 *  - a CAS retry loop that has no side effect until it succeeds is one
 *    atomic step (d_step); reads that are only "more conservative" when
 *    stale (HEAD in [P1]) read the current value;
 *  - doorbells/futexes are blocking guards; timeouts are nondeterministic
 *    choices (strictly more adversarial than a clock);
 *  - the consumer advances HEAD in the same step as the release / skip /
 *    steal that finished a slot (a separate step when a quarantine clears);
 *    the application may keep at most MAXHOLD delivered views across other
 *    steps, at most MAXBATCH at a time, and releases the views it keeps all
 *    together in one step (a batch release: Batch.release); every other view
 *    is released right after delivery (still a separate step from the
 *    checksum verification);
 *  - a run (recv_many's native take) verifies up to MAXRUN consecutive
 *    slots, one step each, and publishes CURSOR and advances HEAD only when
 *    it ends: producers read the published CURSOR (pcursor), which lags the
 *    consumer's own while a run is in progress;
 *  - epochs (producer re-registration) and consumer crash/re-attach are not
 *    modelled; "dead" detection of a crashed producer is immediate; sends
 *    never give up with RingFull (a wait that never ends is a deadlock).
 *
 * Faults: any producer may stall at any point (interleaving); the consumer
 * may steal a pending slot at any point (at most MAXSTEAL times from live
 * producers, unboundedly from dead ones -- the timer always fires
 * eventually); at most MAXCRASH producers crash (stop forever) at any point;
 * at most MAXCORRUPT committed records fail their checksum (bit flip).
 *
 * Invariants (assert):
 *  - no duplicate, per-producer order: the k-th delivery of p is seq k;
 *  - nothing corrupt delivered: when the application releases a delivered
 *    view every unit still carries the record's (p, seq) stamp;
 *  - quarantine: a producer only ever writes units its own reservation owns
 *    (ghost `own`), and HEAD passes a stolen RESERVED slot only once its
 *    producer acknowledged the fence or died (ghost `stolen_p`);
 *    -DNO_WRITE_MONITOR drops both checks;
 *  - lap-specific words: the consumer never sees a W0/W1 of another lap;
 *  - no loss: at the end every message of every non-crashed producer was
 *    delivered; no invalid end state (deadlock): pan's end-state check.
 *
 * -DHEADER_ONLY: the consumer checks the header unit only (a ring created
 * with verify_payload=False); bit flips then stand for flips in the header.
 * The invariants above must still hold: torn and late writes are excluded by
 * the commit CAS and quarantine, not by the payload checksum.
 *
 * Mutants (spin -D...): each must make the verifier report an error.
 *  BUG_NO_QUARANTINE  a stolen RESERVED slot's span is reusable at once
 *  BUG_NO_FENCE       [P6] commit is a plain store, not a CAS
 *  BUG_NO_DEDUP       [C] any good record is delivered, whatever its seq
 *  BUG_NO_GOBACKN     producers never retransmit dropped messages
 *  BUG_STEAL_FREE_WAITS_FOR_END  a FREE slot is stolen only once its span
 *                     end (next W1 or TAIL) is known -- instead of stealing
 *                     at once and keeping HEAD's bytes until it is known
 *  BUG_BATCH_FREES_RUN  a batch release finishes every slot from its first
 *                     view to its last, a stolen (quarantined) one between
 *                     them included: release by range, not by view
 */

#ifndef NPROD
#define NPROD 2          /* producers */
#endif
#ifndef NMSG
#define NMSG 2           /* messages per producer */
#endif
#ifndef NSLOT
#define NSLOT 2          /* size-region entries (S) */
#endif
#ifndef NBUF
#define NBUF 3           /* buffer units (B) */
#endif
#ifndef MAXSTEAL
#define MAXSTEAL 1       /* consumer timeouts against live producers */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1       /* producer crashes */
#endif
#ifndef MAXHOLD
#define MAXHOLD 1        /* deliveries whose view the app keeps across other steps */
#endif
#ifndef MAXCORRUPT
#define MAXCORRUPT 1     /* checksum failures (bit flips) */
#endif
#ifndef MAXBATCH
#define MAXBATCH 1       /* delivered views the app keeps at once (released together) */
#endif
#ifndef MAXRUN
#define MAXRUN 1         /* slots one run verifies before publishing CURSOR (recv_many) */
#endif

/* message k of producer p is 1 or 2 units long (alternating) */
#define MSZ(p, k)     (1 + (((p) + (k)) % 2))
/* [P1] padding to the wrap point when the record would cross the end */
#define PAD(st, u)    ((((st) % NBUF) + (u) > NBUF) -> (NBUF - ((st) % NBUF)) : 0)
/* per-unit payload stamp (0 = never written) */
#define STAMP(p, k)   ((p) * 8 + (k) + 1)
#define S_PROD(x)     (((x) - 1) / 8)
#define S_SEQ(x)      (((x) - 1) % 8)

/* W0 states */
#define FREE          0
#define RESERVED      1
#define COMMITTED     2
#define ABANDONED     3
#define ABANDON_ACKED 4

#define NONE 255

/* ---------------- shared memory ---------------- */
typedef Word0 { byte lap; byte st; byte p; byte u };  /* W0 = (slot|state|producer|units) */
typedef Word1 { byte lap; byte start };               /* W1 = (slot|start)                */

Word0 w0[NSLOT];
Word1 w1[NSLOT];
byte  buf[NBUF];             /* buffer region: stamp of the last writer of each unit */

byte tail_s, tail_b;         /* TAIL = (slot | bytes) */
byte head_s, head_b;         /* HEAD = (slot | bytes), written by the consumer only */
byte cursor;                 /* the next slot the consumer examines (its own) */
byte pcursor;                /* CURSOR as published: what producers read */
byte acked[NPROD];           /* ACKED[p]: released messages of p, in order */
bool dead[NPROD];            /* producer p is known dead (pid gone / conn closed) */

/* fault budgets and the crash trigger */
byte steals, corrupts, holds;
bool crash_req[NPROD];

/* ghosts (not part of the protocol, only used by assertions / fairness) */
byte resv[NSLOT];            /* who reserved the slot in its current lap */
byte own[NBUF];              /* slot whose record currently owns each unit */
byte stolen_p[NSLOT];        /* producer + 1 of a RESERVED slot stolen in this lap, else 0 */
byte dlv[NPROD];             /* messages of p delivered so far */
byte nfin;                   /* producer processes that have terminated */

/* ---------------- producer ---------------- */
proctype Producer(byte p)
{
	byte nxt = 0;            /* next message to (re)send: the go-back-N pointer */
	byte sl[NMSG];           /* slot each message was last committed in */
	byte k, u, stamp, s, st, pad, i;
	bool ok;

	{
	do
	:: nxt < acked[p] -> nxt = acked[p]    /* acked messages leave the retransmit buffer */
	:: d_step { nxt >= acked[p] && nxt < NMSG ->
		k = nxt; u = MSZ(p, k); stamp = STAMP(p, k) };
send:	skip;
		/* [P1]+[P2] wait for room (slot and units, incl. wrap padding), then
		 * CAS(TAIL, T, T + (1 slot, pad + u units)). */
		d_step {
			(tail_s - head_s < NSLOT) &&
			(tail_b + PAD(tail_b, u) + u - head_b <= NBUF);
			s = tail_s; st = tail_b; pad = PAD(st, u);
			tail_s++; tail_b = st + pad + u;
			assert(tail_s < 200);
			resv[s % NSLOT] = p;
			own[(st + pad) % NBUF] = s;
			own[(st + pad + u - 1) % NBUF] = s     /* u <= 2 */
		};
		/* [P3] publish the span start; a W1 naming a later lap means we are a
		 * zombie from an older lap: abort (nothing written, retransmit). */
		d_step {
			if
			:: w1[s % NSLOT].lap != NONE && w1[s % NSLOT].lap > s -> ok = false
			:: else -> w1[s % NSLOT].lap = s; w1[s % NSLOT].start = st; ok = true
			fi
		};
		/* [P4] claim: CAS(W0, (s, FREE), (s, RESERVED, p, u)); failure = stolen */
		d_step {
			if
			:: ok && w0[s % NSLOT].lap == s && w0[s % NSLOT].st == FREE ->
				w0[s % NSLOT].st = RESERVED; w0[s % NSLOT].p = p; w0[s % NSLOT].u = u
			:: else -> ok = false
			fi;
			i = 0
		};
		if
		:: !ok -> goto send            /* abort, retransmit as a new reservation */
		:: else -> skip
		fi;
		/* [P5] write header+payload, one unit per step: a producer stalled
		 * here may land its remaining writes arbitrarily late. */
		do
		:: i < u ->
			atomic {
#ifndef NO_WRITE_MONITOR
				/* a (late) write only lands in space nobody else owns */
				assert(own[(st + pad + i) % NBUF] == s);
#endif
				buf[(st + pad + i) % NBUF] = stamp; i++
			}
		:: else -> break
		od;
		/* [P6] commit: CAS(W0, (s, RESERVED, p, u), (s, COMMITTED, p, u)) */
		atomic {
#ifdef BUG_NO_FENCE
			w0[s % NSLOT].lap = s; w0[s % NSLOT].st = COMMITTED;
			w0[s % NSLOT].p = p; w0[s % NSLOT].u = u; ok = true
#else
			if
			:: w0[s % NSLOT].lap == s && w0[s % NSLOT].st == RESERVED &&
			   w0[s % NSLOT].p == p ->
				w0[s % NSLOT].st = COMMITTED; ok = true
			:: else -> ok = false                 /* fault:steal (fenced) */
			fi
#endif
		};
		if
		:: ok ->                      /* [P7] doorbell (implicit); send() returns: accepted */
			d_step { sl[k] = s; nxt++; k = 0; u = 0; stamp = 0; s = 0; st = 0; pad = 0; i = 0; ok = false }
		:: else ->
			/* fenced: CAS(W0, (s, ABANDONED, p, u), (s, ABANDON_ACKED, p, u)),
			 * we will never touch the span again; then retransmit. */
			d_step {                             /* fault:steal */
				if
				:: w0[s % NSLOT].lap == s && w0[s % NSLOT].st == ABANDONED &&
				   w0[s % NSLOT].p == p -> w0[s % NSLOT].st = ABANDON_ACKED
				:: else -> skip
				fi
			};
			goto send
		fi
#ifndef BUG_NO_GOBACKN
	/* go-back-N: CURSOR passed the slot of the oldest unacked message and
	 * ACKED[p] did not: it was dropped; resend it and everything after it. */
	:: d_step { acked[p] < nxt && pcursor > sl[acked[p]] -> nxt = acked[p] }
#endif
	:: acked[p] == NMSG -> break      /* flushed: every message acknowledged */
	od
	} unless {
		/* crash: stop forever, at whatever point we are (see Crasher) */
		crash_req[p] -> dead[p] = true      /* fault:crash */
	};
	nfin++
}

/* Crashes at most MAXCRASH producers, each at an arbitrary moment: the
 * victim's next step is its `unless` escape (escapes have priority). */
active proctype Crasher()
{
#if MAXCRASH > 0
	byte q = 0, n = 0;
	do
	:: q < NPROD - 1 -> q++
	:: atomic {
		crash_req[q] = true; n++;         /* crash producer q (its next step) */
		if
		:: n == MAXCRASH || q == NPROD - 1 -> break
		:: else -> q++
		fi
	   }
	:: break                            /* no (more) crashes */
	od
#else
	skip
#endif
}

/* ---------------- consumer ---------------- */
/* consumer bookkeeping for slots in [HEAD, CURSOR) */
#define F_NONE     0
#define F_SKIPPED  1    /* corrupt / duplicate / out of order / stolen FREE */
#define F_QUAR     2    /* stolen RESERVED: span quarantined */
#define F_HELD     3    /* delivered, view not yet released */
#define F_RELEASED 4

#define FINISHED(x) \
	(fin[x] == F_SKIPPED || fin[x] == F_RELEASED || \
	 (fin[x] == F_QUAR && (w0[x].st == ABANDON_ACKED || dead[qown[x]])))

/* HEAD advances over the longest prefix of finished slots; for each one it
 * first resets W0 to (c + S, FREE) for the next lap, then publishes HEAD and
 * ACKED[p] (released messages of p, in order).  Used inside d_steps. */
inline advance_head()
{
	do
	:: head_s < cursor && FINISHED(head_s % NSLOT) ->
		y = head_s % NSLOT;
		if
		:: cu[y] != 0 ->
			head_b = w1[y].start + PAD(w1[y].start, cu[y]) + cu[y]
		:: else ->
			/* stolen FREE: its span ends where the next slot's W1 starts, or at
			 * TAIL; if neither is known yet keep HEAD's bytes (conservative) */
			if
			:: tail_s == head_s + 1 -> head_b = tail_b
			:: tail_s != head_s + 1 && w1[(head_s + 1) % NSLOT].lap == head_s + 1 ->
				head_b = w1[(head_s + 1) % NSLOT].start
			:: else -> skip
			fi
		fi;
		if
		:: who[y] != 0 -> acked[who[y] - 1]++
		:: else -> skip
		fi;
#ifndef NO_WRITE_MONITOR
		/* quarantine: HEAD passes a stolen RESERVED span only once its producer
		 * acknowledged the fence or died (it may still write there otherwise) */
		assert(stolen_p[y] == 0 || w0[y].st == ABANDON_ACKED || dead[stolen_p[y] - 1]);
#endif
		stolen_p[y] = 0;
		w0[y].lap = head_s + NSLOT; w0[y].st = FREE; w0[y].p = 0; w0[y].u = 0;
		fin[y] = F_NONE; cu[y] = 0; who[y] = 0; qown[y] = 0; resv[y] = 0;
		head_s++;
		if
		:: head_s == tail_s -> head_b = tail_b   /* every reserved span is free */
		:: else -> skip
		fi
	:: else -> break
	od;
	y = 0
}

/* The application releases the views it holds, all together (a batch
 * release): the data of each must still be exactly the record that was
 * verified and delivered. */
inline release_views()
{
#ifdef BUG_BATCH_FREES_RUN
	/* release by range: every slot from the first view to the last is finished */
	if
	:: nheld > 1 ->
		j = hslot[0];
		do
		:: j < hslot[nheld - 1] -> fin[j % NSLOT] = F_RELEASED; j++
		:: else -> break
		od
	:: else -> skip
	fi;
#endif
	j = 0;
	do
	:: j < nheld ->
		i = 0;
		do
		:: i < hu[j] -> assert(buf[(hrs[j] + i) % NBUF] == hstamp[j]); i++   /* nothing corrupt delivered */
		:: else -> break
		od;
		fin[hslot[j] % NSLOT] = F_RELEASED;
		hslot[j] = 0; hrs[j] = 0; hu[j] = 0; hstamp[j] = 0; j++
	:: else -> break
	od;
	nheld = 0; i = 0; j = 0
}

#ifdef BUG_STEAL_FREE_WAITS_FOR_END
/* only steal a FREE slot once its span end is known: deadlocks when the next
 * slot's producer died before [P3] (needs MAXCRASH >= 2) */
#define END_KNOWN(c) (w0[(c) % NSLOT].st != FREE || tail_s == (c) + 1 || \
                      w1[((c) + 1) % NSLOT].lap == (c) + 1)
#else
#define END_KNOWN(c) true  /* steal at once; HEAD keeps its bytes until the end is known */
#endif

active proctype Consumer()
{
	byte expect[NPROD];      /* next sequence expected from each producer */
	byte fin[NSLOT];         /* F_* per physical slot of the window */
	byte cu[NSLOT];          /* units the consumer learned from W0 (0 = unknown) */
	byte qown[NSLOT];        /* owner of a quarantined span */
	byte who[NSLOT];         /* delivered producer + 1, 0 if none */
	byte nheld;              /* views the application holds (a batch) */
	byte hslot[MAXBATCH], hrs[MAXBATCH], hu[MAXBATCH], hstamp[MAXBATCH];  /* each: slot, start, units, stamp */
	byte inrun;                /* slots verified by the run in progress (0: none) */
	byte x, y, p, u, rs, stamp, i, j;
	bool ok, hold;

	do
	/* [C] (c, COMMITTED, p, u): verify magic, lengths, producer id, checksum */
	:: d_step {
		cursor < tail_s && nheld < MAXBATCH && w0[cursor % NSLOT].st == COMMITTED ->
		x = cursor % NSLOT;
		assert(w0[x].lap == cursor);              /* lap-specific words: no ABA */
		assert(w1[x].lap == cursor);              /* [P3] precedes [P4] */
		p = w0[x].p; u = w0[x].u;
		cu[x] = u;
		rs = w1[x].start + PAD(w1[x].start, u);
		stamp = buf[rs % NBUF];
		ok = (stamp != 0 && S_PROD(stamp) == p);
#ifndef HEADER_ONLY
		i = 1;
		do
		:: i < u -> ok = ok && buf[(rs + i) % NBUF] == stamp; i++
		:: else -> break
		od
#endif
	   };
		if
		:: ok && corrupts < MAXCORRUPT -> corrupts++; ok = false   /* fault:corrupt (bit flip) */
		:: ok && holds < MAXHOLD -> holds++; hold = true  /* app keeps the view a while */
		:: true -> skip
		fi;
		d_step {
			if
#ifdef BUG_NO_DEDUP
			:: ok ->
				expect[p] = S_SEQ(stamp) + 1;
#else
			:: ok && S_SEQ(stamp) == expect[p] ->   /* next expected: deliver */
				expect[p]++;
#endif
				/* invariants: no duplicate, per-producer order */
				assert(S_SEQ(stamp) == dlv[p]);
				dlv[p]++;
				fin[x] = F_HELD; who[x] = p + 1;
				hslot[nheld] = cursor; hrs[nheld] = rs; hu[nheld] = u; hstamp[nheld] = stamp;
				nheld++;
				if
				:: !hold && nheld == 1 -> release_views()   /* the app is done at once */
				:: !hold && nheld > 1 ->                    /* done at once with this one only */
					nheld--; i = 0;
					do
					:: i < u -> assert(buf[(rs + i) % NBUF] == stamp); i++
					:: else -> break
					od;
					fin[x] = F_RELEASED;
					hslot[nheld] = 0; hrs[nheld] = 0; hu[nheld] = 0; hstamp[nheld] = 0
				:: else -> skip
				fi
			:: else -> fin[x] = F_SKIPPED          /* corrupt, duplicate or out of order */
			fi;
			cursor++;
			x = 0; p = 0; u = 0; rs = 0; stamp = 0; i = 0; ok = false; hold = false;
			if
			:: inrun + 1 < MAXRUN && cursor < tail_s -> inrun++   /* the run goes on: CURSOR not yet published */
			:: else -> inrun = 0; pcursor = cursor; advance_head()
			fi
		}
	/* a run ends before it reaches MAXRUN (max_n, or the next slot is not committed) */
	:: d_step { inrun > 0 -> inrun = 0; pcursor = cursor; advance_head() }
	/* [C] (c, FREE) with TAIL past c, or (c, RESERVED, ...): the lock timeout
	 * fires -> steal: CAS(W0, seen, (c, ABANDONED, ...)) */
	:: d_step {
		inrun == 0 && cursor < tail_s &&
		(w0[cursor % NSLOT].st == FREE || w0[cursor % NSLOT].st == RESERVED) &&
		END_KNOWN(cursor) &&
		(steals < MAXSTEAL ||
		 dead[(w0[cursor % NSLOT].st == FREE -> resv[cursor % NSLOT] : w0[cursor % NSLOT].p)]) ->
		x = cursor % NSLOT;
		assert(w0[x].lap == cursor);
		if
		:: w0[x].st == FREE ->
			/* never had a byte written; span = up to next W1 or TAIL */
			p = resv[x]; fin[x] = F_SKIPPED; cu[x] = 0
		:: else ->
			p = w0[x].p; cu[x] = w0[x].u; stolen_p[x] = p + 1;
#ifdef BUG_NO_QUARANTINE
			fin[x] = F_SKIPPED
#else
			fin[x] = F_QUAR; qown[x] = p      /* may still be written: quarantine */
#endif
		fi;
		if
		:: !dead[p] -> steals++
		:: else -> skip
		fi;
		w0[x].st = ABANDONED;
		cursor++; pcursor = cursor;
		x = 0; p = 0;
		advance_head()
	   }
	/* the application releases the views it holds (a batch release): their
	 * data must still be exactly the records that were verified and delivered */
	:: d_step {
		inrun == 0 && nheld > 0 ->
		release_views();
		advance_head()
	   }
	/* HEAD advance after a fenced producer acknowledged (ABANDON_ACKED) or
	 * died: the consumer notices on its next poll */
	:: d_step {
		inrun == 0 && head_s < cursor && FINISHED(head_s % NSLOT) ->
		advance_head()
	   }
	/* all producers finished (flushed) or crashed */
	:: inrun == 0 && nfin == NPROD && nheld == 0 -> break
	od;

	/* final check: no loss -- every message of every producer that did not
	 * crash was delivered (exactly once, in order, by the asserts above) */
	p = 0;
	do
	:: p < NPROD -> assert(dead[p] || dlv[p] == NMSG); p++
	:: else -> break
	od
}

init
{
	byte j;
	atomic {
		j = 0;
		do
		:: j < NSLOT -> w0[j].lap = j; w0[j].st = FREE; w1[j].lap = NONE; j++
		:: else -> break
		od;
		j = 0;
		do
		:: j < NPROD -> run Producer(j); j++
		:: else -> break
		od
	}
}
