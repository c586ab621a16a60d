/*
 * HOSTILE (op 0x01F1, docs/probe-guest.md "HOSTILE"): test-only attacks that a malicious guest
 * driver makes on the VMM, replayed from inside the probe so that the host's device models,
 * transport and agent channel meet them as they would from a compromised guest kernel. Part of
 * probe.c (included there, before dispatch): it uses the probe's queues, frames and device setup.
 *
 * Each attack leaves the probe's channel working again where it can: a device the attack broke
 * (or reconfigured with hostile rings) is reset and set up afresh, keeping the bytes the host had
 * already delivered, so the op answers with what the guest saw. Nothing here relies on the VMM
 * behaving: every wait for the device is bounded (HOSTILE_SPIN_LIMIT, or DEVICE_NEEDS_RESET).
 */

/* Free probe memory between the balloon's rings and the receive buffers: one 256-entry queue. */
#define HOSTILE_RING_MEM   0x204000ull /* descriptors +0 (4 KiB), avail +0x1000, used +0x2000 */
#define HOSTILE_QSIZE      256u
#define HOSTILE_SPIN_LIMIT (1ull << 28)
/* An op no guest answers: events carrying it are what a flood of valid chains sends. */
#define HOSTILE_EVENT_OP   0x7FFF

_Static_assert(BALQ_MEM + 0x1000 <= HOSTILE_RING_MEM, "hostile ring after the balloon queue");
_Static_assert(HOSTILE_RING_MEM + 0x3000 <= RXBUF_BASE, "hostile ring before the receive buffers");

/* Attack kinds: the u32 at payload offset 0 (docs/probe-guest.md lists each one's arguments). */
#define H_TX_ALIAS           1
#define H_TX_MALFORMED       2
#define H_AVAIL_JUMP         3
#define H_NOTIFY_FLOOD       4
#define H_CHAIN_FLOOD        5
#define H_FRAME_GARBAGE      6
#define H_FRAME_BYTEWISE     7
#define H_FRAME_FOREIGN_IDS  8
#define H_FRAME_UNKNOWN_TYPE 9
#define H_BALLOON_RANGES     10
#define H_BALLOON_SELF       11
#define H_VIRTIO_STATE       12
#define H_LIVE_REQUEUE       13
#define H_BALLOON_ALIAS      14

/* Defined further down in probe.c. */
static int rx_take_used(int repost);
static void setup_console(uint64_t mmio);
static void setup_balloon(uint64_t mmio);
static void post_rx_buffers(void);

static uint64_t h_console_mmio, h_balloon_mmio; /* from boot info */
/* h_bytes[v] == v: a one-byte descriptor at h_bytes + v carries the byte v. */
static uint8_t h_bytes[256];

static inline void mmio_write8(uint64_t addr, uint8_t v)
{
    __asm__ volatile("movb %0, (%1)" : : "q"(v), "r"(addr) : "memory");
}

static inline void mmio_write16(uint64_t addr, uint16_t v)
{
    __asm__ volatile("movw %0, (%1)" : : "r"(v), "r"(addr) : "memory");
}

static uint32_t dev_status(uint64_t mmio)
{
    return mmio_read32(mmio + VIRTIO_MMIO_STATUS);
}

static void dev_reset(uint64_t mmio)
{
    mmio_write32(mmio + VIRTIO_MMIO_STATUS, 0);
    while (mmio_read32(mmio + VIRTIO_MMIO_STATUS) != 0)
        cpu_relax();
}

/* Writes a queue's registers as given, no checks (the attacks choose what to get wrong). */
static void h_queue_regs(uint64_t mmio, uint32_t index, uint32_t num, uint64_t desc, uint64_t drv,
                         uint64_t dev)
{
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_SEL, index);
    vq_write_regs(mmio, num, desc, drv, dev);
}

/*
 * Waits until q's used.idx is `target`, the device sets DEVICE_NEEDS_RESET, or the spin limit
 * passes; returns how many chains came back since used.idx was `from`.
 */
static uint16_t h_wait_used(const struct vq *q, uint16_t from, uint16_t target)
{
    for (uint64_t spin = 0; spin < HOSTILE_SPIN_LIMIT; spin++) {
        if (vq_used_idx(q) == target)
            break;
        if ((spin & 0x3FF) == 0x3FF && (dev_status(q->mmio) & VIRTIO_STATUS_NEEDS_RESET))
            break;
        cpu_relax();
    }
    return (uint16_t)(vq_used_idx(q) - from);
}

/*
 * Resets the console and sets it up again as at boot, keeping what the host had delivered (the
 * host keeps what it had not for the new receive buffers). The transmit queue must be idle
 * (tx_drain) or broken: a frame in flight would be lost.
 */
static void console_restart(void)
{
    dev_reset(h_console_mmio);
    rx_take_used(0); /* the device delivers nothing after the reset */
    setup_console(h_console_mmio);
    memset(tx_busy, 0, sizeof(tx_busy));
    post_rx_buffers();
}

/*
 * Makes queue `index` of a device whose features are negotiated ready as a 256-entry queue (or
 * QueueNumMax) at HOSTILE_RING_MEM, then sets DRIVER_OK.
 */
static void hostile_queue(struct vq *hq, uint64_t mmio, uint32_t index)
{
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_SEL, index);
    uint32_t size = HOSTILE_QSIZE, max = mmio_read32(mmio + VIRTIO_MMIO_QUEUE_NUM_MAX);
    while (size > max && size > 1)
        size >>= 1;
    vq_place(hq, mmio, index, size, HOSTILE_RING_MEM, 0x1000, 0x2000, 0x3000);
    vdev_set_status(mmio, VIRTIO_STATUS_DRIVER_OK);
}

/*
 * Resets the console with its transmit queue idle and makes only that queue ready, as a hostile
 * queue (the receive queue is not ready: the host keeps its bytes for after console_restart).
 */
static void console_hostile_txq(struct vq *hq)
{
    tx_drain();
    dev_reset(h_console_mmio);
    rx_take_used(0);
    vdev_begin(h_console_mmio, VIRTIO_ID_CONSOLE, 1ull << VIRTIO_F_VERSION_1, ABORT_CONSOLE_DEVICE,
               ABORT_CONSOLE_FEATURES, "virtio-console");
    hostile_queue(hq, h_console_mmio, 1);
}

/* Sets the balloon up with only its reporting queue ready, as a hostile queue; 0 without reporting. */
static int balloon_hostile_q(struct vq *hq)
{
    if (!h_balloon_mmio || !st.reporting)
        return 0;
    vdev_begin(h_balloon_mmio, VIRTIO_ID_BALLOON,
               (1ull << VIRTIO_F_VERSION_1) | (1ull << VIRTIO_BALLOON_F_REPORTING),
               ABORT_BALLOON_DEVICE, ABORT_BALLOON_FEATURES, "virtio-balloon");
    hostile_queue(hq, h_balloon_mmio, VIRTIO_BALLOON_REPORTING_QUEUE);
    return 1;
}

static inline void h_desc(volatile struct virtq_desc *d, uint64_t addr, uint32_t len,
                          uint16_t flags, uint16_t next)
{
    d->addr = addr;
    d->len = len;
    d->flags = flags;
    d->next = next;
}

/* Sends `len` bytes (at most a transmit buffer) as one descriptor, whatever they are. */
static void send_raw(const void *p, uint32_t len)
{
    uint32_t slot = tx_slot();
    uint8_t *buf = (uint8_t *)(TXBUF_BASE + (uint64_t)slot * TXBUF_SIZE);
    memcpy(buf, p, len);
    tx_post(slot, (uint64_t)buf, len);
}

/* A header as pv_frame_header_put writes it, then with the magic and version given (good or bad). */
static void raw_hdr(uint8_t *h, uint8_t m0, uint8_t m1, uint8_t version, uint8_t type, uint32_t id,
                    uint16_t op, uint32_t len)
{
    pv_frame_header_put(h, type, id, op, 0, len);
    h[0] = m0;
    h[1] = m1;
    h[2] = version;
}

/* out[0..2]: the op's three counts (docs/probe-guest.md, per kind). */

/*
 * One chain of `ndesc` descriptors that all point at the same `dlen` bytes of guest RAM (wsBase),
 * made available `chains` times (the same head in every avail entry), a ring's worth per notify:
 * on the console's transmit queue (device-readable) or the balloon's reporting queue (a report).
 * 0 if the balloon has no reporting.
 */
static int h_alias(uint32_t chains, uint64_t ndesc, uint64_t dlen, int balloon, uint64_t *out)
{
    struct vq hq;
    if (!balloon)
        console_hostile_txq(&hq);
    else if (!balloon_hostile_q(&hq))
        return 0;
    if (ndesc == 0)
        ndesc = 1;
    if (ndesc > hq.size)
        ndesc = hq.size;
    uint16_t flags = balloon ? VIRTQ_DESC_F_WRITE : 0;
    for (uint32_t i = 0; i < ndesc; i++)
        h_desc(&hq.desc[i], st.ws_base, (uint32_t)dlen,
               flags | (i + 1 < ndesc ? VIRTQ_DESC_F_NEXT : 0), (uint16_t)(i + 1));
    uint64_t posted = 0, returned = 0;
    while (posted < chains) {
        uint32_t n = chains - posted < hq.size ? (uint32_t)(chains - posted) : hq.size;
        uint16_t from = hq.avail_idx;
        for (uint32_t k = 0; k < n; k++)
            vq_push(&hq, 0);
        vq_kick(&hq);
        uint16_t got = h_wait_used(&hq, from, hq.avail_idx);
        posted += n;
        returned += got;
        if (got != n)
            break; /* the device stopped taking them */
    }
    out[0] = posted;
    out[1] = returned;
    out[2] = dev_status(hq.mmio);
    if (balloon)
        setup_balloon(h_balloon_mmio);
    else
        console_restart();
    return 1;
}

/*
 * Rounds of malformed transmit chains: a two-descriptor loop, a self-loop, `next` out of range,
 * an indirect descriptor (not negotiated), buffers outside RAM (the MMIO hole, 1 TiB), and an
 * avail entry naming a head beyond the ring, which the device cannot return (6 of 7 come back).
 */
static void h_tx_malformed(uint32_t rounds, uint64_t *out)
{
    struct vq hq;
    console_hostile_txq(&hq);
    volatile struct virtq_desc *d = hq.desc;
    h_desc(&d[0], st.ws_base, 1, VIRTQ_DESC_F_NEXT, 1);
    h_desc(&d[1], st.ws_base, 1, VIRTQ_DESC_F_NEXT, 0);
    h_desc(&d[2], st.ws_base, 1, VIRTQ_DESC_F_NEXT, 2);
    h_desc(&d[3], st.ws_base, 1, VIRTQ_DESC_F_NEXT, 0xFFFF);
    h_desc(&d[4], st.ws_base, 16, 4 /* VIRTQ_DESC_F_INDIRECT */, 0);
    h_desc(&d[5], LOW_RAM_END, PAGE_SIZE, 0, 0);
    h_desc(&d[6], 1ull << 40, 1, 0, 0);
    static const uint16_t heads[] = {0, 2, 3, 4, 5, 6, 0xFFFF};
    uint64_t posted = 0, returned = 0;
    for (uint32_t r = 0; r < rounds; r++) {
        uint16_t from = vq_used_idx(&hq);
        for (uint32_t k = 0; k < sizeof(heads) / sizeof(heads[0]); k++)
            vq_push(&hq, heads[k]);
        vq_kick(&hq);
        uint16_t got = h_wait_used(&hq, from, (uint16_t)(from + 6));
        posted += sizeof(heads) / sizeof(heads[0]);
        returned += got;
        if (got != 6)
            break;
    }
    out[0] = posted;
    out[1] = returned;
    out[2] = dev_status(h_console_mmio);
    console_restart();
}

/*
 * Publishes an available index `jump` entries ahead of what the driver posted, on the console's
 * transmit queue (which 0) or the balloon's reporting queue (which 1), and notifies. A device
 * that checks refuses the queue (DEVICE_NEEDS_RESET); the probe then resets it and goes on.
 */
static int h_avail_jump(uint32_t jump, uint64_t which, uint64_t *out)
{
    struct vq *q;
    if (which == 0) {
        tx_drain();
        q = &txq;
    } else if (which == 1 && st.reporting) {
        q = &balq;
    } else {
        return 0;
    }
    uint16_t idx = (uint16_t)(q->avail_idx + jump);
    barrier();
    q->avail->idx = idx;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    mmio_write32(q->mmio + VIRTIO_MMIO_QUEUE_NOTIFY, q->index);
    out[0] = jump;
    out[1] = (uint16_t)(vq_used_idx(q) - q->last_used);
    out[2] = dev_status(q->mmio);
    if (which == 0)
        console_restart();
    else
        setup_balloon(h_balloon_mmio);
    return 1;
}

/*
 * `count` QueueNotify writes with nothing new to take: the console's queues in turn, queue
 * indices no device has, and every eighth to the balloon's reporting queue.
 */
static void h_notify_flood(uint32_t count, uint64_t *out)
{
    static const uint32_t idx[] = {1, 0, 2, 3, 7, 0xFFFF, 0xFFFFFFFFu};
    for (uint32_t i = 0; i < count; i++) {
        if (h_balloon_mmio && (i & 7) == 7)
            mmio_write32(h_balloon_mmio + VIRTIO_MMIO_QUEUE_NOTIFY, VIRTIO_BALLOON_REPORTING_QUEUE);
        else
            mmio_write32(h_console_mmio + VIRTIO_MMIO_QUEUE_NOTIFY, idx[i % 7]);
    }
    out[0] = count;
}

/* `count` valid chains, one notify each: a 16-byte event of an op nobody answers in each. */
static void h_chain_flood(uint32_t count, uint64_t *out)
{
    for (uint32_t i = 0; i < count; i++)
        send_frame(PV_T_EVENT, i, HOSTILE_EVENT_OP, 0, 0);
    out[0] = count;
}

/*
 * Rounds of what a broken or malicious agent writes on the channel, each piece its own chain:
 * 4 KiB of random bytes (first byte 0), a header with bad magic, one of version 2, one declaring
 * 4 GiB - 1 bytes, one declaring 1 MiB + 1, and a valid event split 5 / 19 bytes over two chains.
 */
static void h_frame_garbage(uint32_t rounds, uint64_t *out)
{
    uint32_t x = 0x9E3779B9u, sent = 0;
    uint8_t h[PV_FRAME_HDR + 8];
    for (uint32_t r = 0; r < rounds; r++) {
        uint32_t slot = tx_slot();
        uint8_t *buf = (uint8_t *)(TXBUF_BASE + (uint64_t)slot * TXBUF_SIZE);
        for (uint32_t i = 0; i < TXBUF_SIZE; i++) {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            buf[i] = (uint8_t)x;
        }
        buf[0] = 0;
        tx_post(slot, (uint64_t)buf, TXBUF_SIZE);
        raw_hdr(h, PV_FRAME_MAGIC0, 'X', PV_FRAME_VERSION, PV_T_EVENT, 0, HOSTILE_EVENT_OP, 0);
        send_raw(h, PV_FRAME_HDR);
        raw_hdr(h, PV_FRAME_MAGIC0, PV_FRAME_MAGIC1, 2, PV_T_EVENT, 0, HOSTILE_EVENT_OP, 0);
        send_raw(h, PV_FRAME_HDR);
        raw_hdr(h, PV_FRAME_MAGIC0, PV_FRAME_MAGIC1, PV_FRAME_VERSION, PV_T_RESPONSE, 1, OP_PING, 0xFFFFFFFFu);
        send_raw(h, PV_FRAME_HDR);
        raw_hdr(h, PV_FRAME_MAGIC0, PV_FRAME_MAGIC1, PV_FRAME_VERSION, PV_T_RESPONSE, 1, OP_PING,
                PV_FRAME_MAX_PAYLOAD + 1);
        send_raw(h, PV_FRAME_HDR);
        raw_hdr(h, PV_FRAME_MAGIC0, PV_FRAME_MAGIC1, PV_FRAME_VERSION, PV_T_EVENT, 0, HOSTILE_EVENT_OP, 8);
        wr64(h + PV_FRAME_HDR, r);
        send_raw(h, 5);
        send_raw(h + 5, sizeof(h) - 5);
        sent += 7;
    }
    out[0] = sent;
}

/*
 * The answer to this request sent one byte per chain (header included), `len` payload bytes of
 * the pattern b[i] = (i + (i >> 8)) & 0xFF, a ring's worth of chains per notify.
 */
static void h_frame_bytewise(uint32_t id, uint32_t len)
{
    uint8_t hdr[PV_FRAME_HDR];
    pv_frame_header_put(hdr, PV_T_RESPONSE, id, OP_HOSTILE, 0, len);
    tx_drain();
    uint32_t total = PV_FRAME_HDR + len, n = 0;
    for (uint32_t pos = 0; pos < total; pos++) {
        uint32_t i = pos - PV_FRAME_HDR;
        uint8_t b = pos < PV_FRAME_HDR ? hdr[pos] : (uint8_t)(i + (i >> 8));
        h_desc(&txq.desc[n], (uint64_t)&h_bytes[b], 1, 0, 0);
        vq_push(&txq, (uint16_t)n);
        if (++n == txq.size || pos + 1 == total) {
            vq_kick(&txq);
            tx_drain();
            n = 0;
        }
    }
}

/*
 * Frames for ids the host never asked (0, 2^32 - 1, 2^31 - 1, the previous and the next
 * request's ids) of every answer type, an error whose 4 KiB text starts with terminal escapes and
 * forged log lines, a second HELLO; then this request's answer (out) followed by a second
 * response and an error for it. Returns the frames sent before the answer in out[0].
 */
static void h_frame_foreign_ids(uint32_t id, uint64_t *out)
{
    uint8_t p[32];
    memset(p, 0xA5, sizeof(p));
    static const uint32_t ids[] = {0, 0xFFFFFFFFu, 0x7FFFFFFFu};
    uint32_t sent = 0;
    for (uint32_t k = 0; k < sizeof(ids) / sizeof(ids[0]); k++) {
        send_frame(PV_T_RESPONSE, ids[k], OP_HOSTILE, p, sizeof(p));
        send_frame(PV_T_CHUNK, ids[k], OP_HOSTILE, p, 5);
        send_frame(PV_T_ERROR, ids[k], OP_HOSTILE, p, 8);
        sent += 3;
    }
    /* An error whose text would forge host log lines and drive a terminal, as long as a frame
     * in one transmit buffer allows. */
    static const char forged[] = "\x1b[2J\x1b]0;pvisor\x07\nhost: all VMs healthy\n";
    uint8_t e[TXBUF_SIZE - PV_FRAME_HDR];
    wr32(e, ERR_BAD_ARGUMENT);
    memset(e + 4, 'A', sizeof(e) - 4);
    memcpy(e + 4, forged, sizeof(forged) - 1);
    send_frame(PV_T_ERROR, 0x7FFFFFFEu, OP_HOSTILE, e, sizeof(e));
    sent++;
    send_frame(PV_T_RESPONSE, id - 1, OP_HOSTILE, p, sizeof(p)); /* answered already, or none */
    send_frame(PV_T_RESPONSE, id + 1, OP_HOSTILE, p, sizeof(p)); /* not asked yet */
    send_frame(PV_T_ERROR, id + 1, OP_HOSTILE, p, 8);
    sent += 3;
    uint8_t hello[32];
    wr32(hello, 1);
    wr32(hello + 4, 1);
    wr64(hello + 8, st.ram_bytes);
    wr64(hello + 16, st.ws_base);
    wr64(hello + 24, st.ws_limit);
    send_frame(PV_T_EVENT, 0, OP_HELLO, hello, sizeof(hello));
    sent++;
    out[0] = sent;
}

/*
 * Reports of ranges a driver must not report, each its own chain, one notify: beyond RAM,
 * straddling its end, in the MMIO hole, on the console's registers, wrapping 2^64, at 2^52,
 * unaligned inside a page and across two, of length 0, of 4 GiB - 1, an indirect descriptor, and
 * two of the probe's own idle areas (its transmit buffers and the hostile ring).
 */
static int h_balloon_ranges(uint64_t *out)
{
    if (!st.reporting)
        return 0;
    tx_drain();
    uint64_t ram_end = st.ram_bytes < LOW_RAM_END ? st.ram_bytes : LOW_RAM_END;
    const struct {
        uint64_t addr;
        uint32_t len;
        uint16_t flags;
    } r[] = {
        {ram_end, PAGE_SIZE, VIRTQ_DESC_F_WRITE},
        {ram_end - PAGE_SIZE, 2 * PAGE_SIZE, VIRTQ_DESC_F_WRITE},
        {LOW_RAM_END, PAGE_SIZE, VIRTQ_DESC_F_WRITE},
        {h_console_mmio, PAGE_SIZE, VIRTQ_DESC_F_WRITE},
        {0xFFFFFFFFFFFFF000ull, 2 * PAGE_SIZE, VIRTQ_DESC_F_WRITE},
        {1ull << 52, PAGE_SIZE, VIRTQ_DESC_F_WRITE},
        {st.ws_base + 1, PAGE_SIZE - 1, VIRTQ_DESC_F_WRITE},
        {st.ws_base + PAGE_SIZE / 2, PAGE_SIZE, VIRTQ_DESC_F_WRITE},
        {st.ws_base, 0, VIRTQ_DESC_F_WRITE},
        {st.ws_base, 0xFFFFFFFFu, VIRTQ_DESC_F_WRITE},
        {st.ws_base, PAGE_SIZE, VIRTQ_DESC_F_WRITE | 4 /* VIRTQ_DESC_F_INDIRECT */},
        {TXBUF_BASE, TXQ_SIZE * TXBUF_SIZE, VIRTQ_DESC_F_WRITE},
        {HOSTILE_RING_MEM, 0x3000, VIRTQ_DESC_F_WRITE},
    };
    uint32_t n = sizeof(r) / sizeof(r[0]);
    _Static_assert(sizeof(r) / sizeof(r[0]) <= BALQ_SIZE, "one batch");
    uint16_t from = vq_used_idx(&balq);
    for (uint32_t i = 0; i < n; i++) {
        h_desc(&balq.desc[i], r[i].addr, r[i].len, r[i].flags, 0);
        vq_push(&balq, (uint16_t)i);
    }
    vq_kick(&balq);
    out[0] = n;
    out[1] = h_wait_used(&balq, from, balq.avail_idx);
    out[2] = dev_status(h_balloon_mmio);
    balq.last_used = vq_used_idx(&balq);
    return 1;
}

/*
 * Reports all of low RAM free, the probe's page tables, code and stack included: what a guest
 * that has lost its mind does to itself. The VM is not expected to survive it.
 */
static int h_balloon_self(uint64_t *out)
{
    if (!st.reporting)
        return 0;
    tx_drain();
    uint64_t ram_end = st.ram_bytes < LOW_RAM_END ? st.ram_bytes : LOW_RAM_END;
    uint32_t len = ram_end > 0xFFFFF000ull ? 0xFFFFF000u : (uint32_t)ram_end;
    uint16_t from = vq_used_idx(&balq);
    h_desc(&balq.desc[0], 0, len, VIRTQ_DESC_F_WRITE, 0);
    vq_push(&balq, 0);
    vq_kick(&balq);
    out[0] = 1;
    out[1] = h_wait_used(&balq, from, balq.avail_idx);
    out[2] = dev_status(h_balloon_mmio);
    balq.last_used = vq_used_idx(&balq);
    return 1;
}

/* Reset, ACKNOWLEDGE, DRIVER, VERSION_1 only, FEATURES_OK (no checks: the caller looks). */
static void h_negotiate(uint64_t mmio)
{
    dev_reset(mmio);
    mmio_write32(mmio + VIRTIO_MMIO_STATUS, VIRTIO_STATUS_ACKNOWLEDGE | VIRTIO_STATUS_DRIVER);
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES, 0);
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES, 1u << (VIRTIO_F_VERSION_1 - 32));
    mmio_write32(mmio + VIRTIO_MMIO_STATUS,
                 VIRTIO_STATUS_ACKNOWLEDGE | VIRTIO_STATUS_DRIVER | VIRTIO_STATUS_FEATURES_OK);
}

#define ST_AD  (VIRTIO_STATUS_ACKNOWLEDGE | VIRTIO_STATUS_DRIVER)
#define ST_ADF (ST_AD | VIRTIO_STATUS_FEATURES_OK)

/* Queue 0 with the given registers, made ready, then DRIVER_OK; 1 if the device refused it. */
static int h_refused_queue(uint64_t mmio, uint32_t num, uint64_t desc, uint64_t drv, uint64_t dev)
{
    h_negotiate(mmio);
    h_queue_regs(mmio, 0, num, desc, drv, dev);
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_READY, 1);
    mmio_write32(mmio + VIRTIO_MMIO_STATUS, ST_ADF | VIRTIO_STATUS_DRIVER_OK);
    return (dev_status(mmio) & VIRTIO_STATUS_NEEDS_RESET) != 0;
}

/*
 * The virtio status state machine abused from the driver side on the balloon, one step per bit of
 * out[1] (set when the device did what the spec asks); the balloon is set up afresh afterwards.
 */
static int h_virtio_state(uint64_t *out)
{
    uint64_t m = h_balloon_mmio;
    if (!m)
        return 0;
    uint32_t ok = 0, step = 0;
    const uint64_t q = HOSTILE_RING_MEM;
#define STEP(cond) (ok |= (uint32_t)((cond) ? 1u : 0u) << step++)
    /* 0: DRIVER_OK without FEATURES_OK is refused with DEVICE_NEEDS_RESET. */
    dev_reset(m);
    mmio_write32(m + VIRTIO_MMIO_STATUS, ST_AD);
    mmio_write32(m + VIRTIO_MMIO_STATUS, ST_AD | VIRTIO_STATUS_DRIVER_OK);
    STEP(dev_status(m) & VIRTIO_STATUS_NEEDS_RESET);
    /* 1: a reset clears it. */
    dev_reset(m);
    STEP(dev_status(m) == 0);
    /* 2: features rewritten after FEATURES_OK, then FEATURES_OK cleared by a status write without
     * a reset: the device keeps FEATURES_OK (a driver never clears a status bit). */
    h_negotiate(m);
    mmio_write32(m + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
    mmio_write32(m + VIRTIO_MMIO_DRIVER_FEATURES, 0xFFFFFFFFu);
    mmio_write32(m + VIRTIO_MMIO_STATUS, ST_AD);
    STEP(dev_status(m) == ST_ADF);
    /* 3: features rewritten again (with bits never offered) and FEATURES_OK set again: it sticks,
     * since the features are still the ones agreed. */
    mmio_write32(m + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
    mmio_write32(m + VIRTIO_MMIO_DRIVER_FEATURES, 0xFFFFFFFFu);
    mmio_write32(m + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    mmio_write32(m + VIRTIO_MMIO_DRIVER_FEATURES, 0xFFFFFFFFu);
    mmio_write32(m + VIRTIO_MMIO_STATUS, ST_ADF);
    STEP(dev_status(m) == ST_ADF);
    /* 4-7: queues the device must refuse: unaligned rings, a size that is not a power of two,
     * one above QueueNumMax, rings in the MMIO hole. */
    STEP(h_refused_queue(m, 8, q + 1, q + 0x1000, q + 0x2000));
    STEP(h_refused_queue(m, 3, q, q + 0x1000, q + 0x2000));
    STEP(h_refused_queue(m, 0x10000, q, q + 0x1000, q + 0x2000));
    STEP(h_refused_queue(m, 8, LOW_RAM_END, LOW_RAM_END + 0x1000, LOW_RAM_END + 0x2000));
    /* 8: a queue index the device does not have reads QueueNumMax 0 and takes no writes. */
    h_negotiate(m);
    mmio_write32(m + VIRTIO_MMIO_QUEUE_SEL, 99);
    mmio_write32(m + VIRTIO_MMIO_QUEUE_READY, 1);
    STEP(mmio_read32(m + VIRTIO_MMIO_QUEUE_NUM_MAX) == 0 &&
         mmio_read32(m + VIRTIO_MMIO_QUEUE_READY) == 0);
    /* 9: 8- and 16-bit writes to Status are not register writes. */
    mmio_write8(m + VIRTIO_MMIO_STATUS, 0xFF);
    mmio_write16(m + VIRTIO_MMIO_STATUS, 0xFFFF);
    STEP(dev_status(m) == ST_ADF);
    /* 10: DRIVER_OK with no queue ready, then a notify of every queue: nothing to take. */
    mmio_write32(m + VIRTIO_MMIO_STATUS, ST_ADF | VIRTIO_STATUS_DRIVER_OK);
    for (uint32_t i = 0; i < 4; i++)
        mmio_write32(m + VIRTIO_MMIO_QUEUE_NOTIFY, i);
    STEP(dev_status(m) == (ST_ADF | VIRTIO_STATUS_DRIVER_OK));
#undef STEP
    setup_balloon(m);
    out[0] = step;
    out[1] = ok;
    out[2] = dev_status(m);
    return 1;
}

/*
 * While the console is live: its queues' registers rewritten (size 3, rings at unaligned and
 * unmapped addresses, QueueReady 0), its features rewritten, and a status write that clears every
 * bit but ACKNOWLEDGE. The op then answers through the rings it set up at boot, which the device
 * must still be using.
 */
static void h_live_requeue(uint64_t *out)
{
    tx_drain();
    uint32_t writes = 0;
    for (uint32_t i = 0; i < 2; i++) {
        h_queue_regs(h_console_mmio, i, 3, 0xFFFF00000001ull, 3, LOW_RAM_END + 5);
        mmio_write32(h_console_mmio + VIRTIO_MMIO_QUEUE_READY, 0);
        writes += 9;
    }
    mmio_write32(h_console_mmio + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
    mmio_write32(h_console_mmio + VIRTIO_MMIO_DRIVER_FEATURES, 0xFFFFFFFFu);
    mmio_write32(h_console_mmio + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    mmio_write32(h_console_mmio + VIRTIO_MMIO_DRIVER_FEATURES, 0xFFFFFFFFu);
    mmio_write32(h_console_mmio + VIRTIO_MMIO_STATUS, VIRTIO_STATUS_ACKNOWLEDGE);
    writes += 5;
    out[0] = writes;
    out[2] = dev_status(h_console_mmio);
}

/*
 * HOSTILE `{u32 kind, u32 count, u64 arg1, u64 arg2}` -> `{u64 out[3], u64 tscCycles}`, except
 * where a kind answers otherwise (docs/probe-guest.md).
 */
static void op_hostile(uint32_t id, const uint8_t *p, uint32_t len)
{
    if (len < 24) {
        respond_error(id, OP_HOSTILE, ERR_BAD_ARGUMENT, "HOSTILE: payload too short");
        return;
    }
    uint32_t kind = rd32(p), count = rd32(p + 4);
    uint64_t arg1 = rd64(p + 8), arg2 = rd64(p + 16);
    uint64_t out[3] = {0, 0, 0};
    for (uint32_t i = 0; i < 256; i++)
        h_bytes[i] = (uint8_t)i;
    uint64_t t0 = rdtsc();
    uint32_t err = 0; /* ERR_NO_REPORTING, or ERR_BAD_ARGUMENT: the kind cannot run here */
    switch (kind) {
    case H_TX_ALIAS:
    case H_BALLOON_ALIAS:
        err = h_alias(count, arg1, arg2, kind == H_BALLOON_ALIAS, out) ? 0 : ERR_NO_REPORTING;
        break;
    case H_TX_MALFORMED:
        h_tx_malformed(count, out);
        break;
    case H_AVAIL_JUMP:
        err = h_avail_jump(count, arg1, out) ? 0 : ERR_BAD_ARGUMENT;
        break;
    case H_NOTIFY_FLOOD:
        h_notify_flood(count, out);
        break;
    case H_CHAIN_FLOOD:
        h_chain_flood(count, out);
        break;
    case H_FRAME_GARBAGE:
        h_frame_garbage(count, out);
        break;
    case H_FRAME_BYTEWISE:
        if (count > PV_FRAME_MAX_PAYLOAD) {
            err = ERR_BAD_ARGUMENT;
            break;
        }
        h_frame_bytewise(id, count);
        return; /* that was the answer */
    case H_FRAME_FOREIGN_IDS:
        h_frame_foreign_ids(id, out);
        break;
    case H_FRAME_UNKNOWN_TYPE:
        send_frame(PV_T_CHUNK, id, OP_HOSTILE, "chunk", 5);
        send_frame((uint8_t)count, id, OP_HOSTILE, 0, 0);
        return; /* no other answer */
    case H_BALLOON_RANGES:
        err = h_balloon_ranges(out) ? 0 : ERR_NO_REPORTING;
        break;
    case H_BALLOON_SELF:
        err = h_balloon_self(out) ? 0 : ERR_NO_REPORTING;
        break;
    case H_VIRTIO_STATE:
        err = h_virtio_state(out) ? 0 : ERR_BAD_ARGUMENT;
        break;
    case H_LIVE_REQUEUE:
        h_live_requeue(out);
        break;
    default:
        err = ERR_BAD_ARGUMENT;
        break;
    }
    if (err) {
        respond_error(id, OP_HOSTILE, err,
                      err == ERR_NO_REPORTING ? "HOSTILE: no free page reporting"
                                              : "HOSTILE: unknown kind, or bad arguments for it");
        return;
    }
    uint64_t t1 = rdtsc();
    uint8_t res[32];
    wr64(res, out[0]);
    wr64(res + 8, out[1]);
    wr64(res + 16, out[2]);
    wr64(res + 24, t1 - t0);
    respond(id, OP_HOSTILE, res, sizeof(res));
    if (kind == H_FRAME_FOREIGN_IDS) {
        respond(id, OP_HOSTILE, res, sizeof(res));
        respond_error(id, OP_HOSTILE, ERR_BAD_ARGUMENT, "HOSTILE: a second answer");
    }
}
