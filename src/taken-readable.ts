/**
 * A Readable that tells its owner each time its consumer has taken from it: the hook a stream
 * under credit needs to grant the sender more (the agent's streams, ./guest/guest-output.ts;
 * the control socket's, ./control-stream-client.ts).
 */
import { Readable } from 'node:stream';

/**
 * A Readable that says when its consumer has taken from it. Every way of consuming one goes
 * through `read()` (a paused reader's calls, flowing mode's loop, the read(0) that follows a
 * chunk handed straight to a 'data' listener), whereas `_read()` is not called again while an
 * earlier call has had no push: a stream whose guest has too little credit left to send anything
 * would never be asked again, and never grant.
 */
export class TakenReadable extends Readable {
  constructor(
    options: ConstructorParameters<typeof Readable>[0],
    private readonly onTaken: () => void,
  ) {
    super(options);
  }

  override read(size?: number): unknown {
    const chunk: unknown = super.read(size);
    this.onTaken();
    return chunk;
  }
}
